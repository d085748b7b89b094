"""pytest plugin for memsentry (``pytest --memsentry``); its hooks arrive with the plugin issue."""
