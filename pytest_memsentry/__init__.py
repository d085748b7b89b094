"""pytest plugin for memsentry: ``pytest --memsentry`` fails tests that leave memory allocated
on a device after they end, and says what leaked and who holds it (``pytest_memsentry.plugin``,
registered through the ``pytest11`` entry point)."""
