"""Memory that Python buffers hold outside tensors and NumPy arrays: a ``bytearray``, a
``memoryview`` (of a bytearray, ``bytes`` or an array) and a DLPack capsule not yet consumed
(``torch.utils.dlpack.to_dlpack(t)`` keeps ``t``'s memory until another library takes it).

Each is read without changing it: no buffer is exported (exporting a ``bytearray`` would make
the user's resize of it fail while the census looks), a capsule's structure is only read.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

#: (device, address) of memory, as the storage ledger keys it; for a Python object's own
#: buffer, whose address is not read, ("bytearray"/"bytes", id of the object).
Key = tuple[str, int]


def _capsule_type() -> type:
    """``PyCapsule``'s type, from a capsule the interpreter already has."""
    import datetime  # datetime.datetime_CAPI is a capsule in every CPython

    return type(datetime.datetime_CAPI)


CAPSULE = _capsule_type()

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):  # DLManagedTensor: the tensor comes first
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack 1.0)
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


#: DLPack's device types, as torch names the devices.
_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "cuda", 13: "cuda"}
_LAYOUTS = {b"dltensor": _Managed, b"dltensor_versioned": _ManagedVersioned}
#: A DLPack tensor with more dimensions than this is not read (none is that deep).
_MAX_DIMS = 64


def dlpack_memory(capsule: Any) -> tuple[Key, int] | None:
    """(key, bytes) of the memory a DLPack capsule keeps, or ``None`` for another capsule, one
    already consumed (renamed ``used_dltensor``) or one that cannot be read."""
    try:
        name = _get_name(capsule)
        layout = _LAYOUTS.get(name or b"")
        if layout is None:
            return None
        address = _get_pointer(capsule, name)
        if not address:
            return None
        tensor = layout.from_address(address).dl_tensor
        if not 0 <= tensor.ndim <= _MAX_DIMS or not tensor.data:
            return None
        elements = math.prod(tensor.shape[i] for i in range(tensor.ndim))
        size = elements * tensor.dtype.bits * max(tensor.dtype.lanes, 1) // 8
        kind = _DEVICES.get(tensor.device.device_type, f"dlpack{tensor.device.device_type}")
        device = kind if kind == "cpu" else f"{kind}:{tensor.device.device_id}"
        return (device, tensor.data + tensor.byte_offset), max(size, 0)
    except Exception:  # a capsule memsentry cannot read is left out
        return None


def buffer_memory(obj: Any) -> tuple[Any, Key | None, int]:
    """What a ``bytearray`` or ``memoryview`` holds: (the object it views when that is a NumPy
    array, to be counted as one, else ``None``; the key and bytes of the memory otherwise,
    ``None`` and 0 when it is released or views memory of another kind)."""
    if isinstance(obj, bytearray):
        return None, ("bytearray", id(obj)), len(obj)
    try:
        viewed = obj.obj
    except ValueError:  # released
        return None, None, 0
    if isinstance(viewed, bytearray | bytes):
        return None, (type(viewed).__name__, id(viewed)), len(viewed)
    if hasattr(viewed, "__array_interface__"):
        return viewed, None, 0
    return None, None, 0
