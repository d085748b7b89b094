"""Adapters for where people train: PyTorch Lightning (:mod:`.lightning`, and
:mod:`.pytorch_lightning` for the older package name), the Hugging Face ``Trainer``
(:mod:`.transformers`) and Jupyter (:mod:`.notebook`, loaded by ``%load_ext memsentry``).

Each is a thin layer over :class:`memsentry.Tracker` (``start()``, ``stop()``, ``report()``)
and imports its framework only when it is itself imported: ``import memsentry`` never does.
"""
