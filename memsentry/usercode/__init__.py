"""Where the user's code is: which stack frames, modules and classes are the user's (not
torch's, memsentry's or the standard library's), and which source line fills a variable.

The foundation layer: it imports nothing of memsentry's, so every layer above may use it.
"""
