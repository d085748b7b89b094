"""NVML (``pynvml`` from the nvidia-ml-py distribution): what the driver sees of a GPU.

Every call returns a value; a missing library, driver, GPU or permission becomes
``NvmlInfo(available=False, reason=...)``, never an exception.

Which GPU: torch's ``cuda:N`` is the N-th device the CUDA runtime enumerates after
``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (fastest first by default), while NVML
numbers GPUs in PCI order and ignores both; NVML's index ``N`` is often another GPU. So the
handle is found by the device's UUID: ``torch.cuda.get_device_properties(N).uuid`` is a
``torch._C._CUuuid`` whose ``str()`` is the bare ``8-4-4-4-12`` hex form
(``registerCudaDeviceProperties`` and ``uuid_to_string`` in torch/csrc/cuda/Module.cpp),
while NVML names a whole GPU ``GPU-<hex>`` and a MIG slice ``MIG-<hex>``;
``nvmlDeviceGetHandleByUUID`` takes either and returns the GPU's handle or the MIG device's
handle. The PCI bus id (``pci_domain_id``, ``pci_bus_id``, ``pci_device_id``) is used only
when no UUID names the device, and only for a GPU that is not in MIG mode and whose NVML
UUID is not another's: a bus id names the whole board, never a slice of it. NVML's own index
is never used, so a device NVML cannot find is reported unavailable, with the reason.

MIG: for a MIG device handle NVML reports the slice's memory (``nvmlDeviceGetMemoryInfo``:
per-instance figures come from MIG device handles, the parent's handle gives the whole GPU)
and the processes running on that instance (``nvmlDeviceGetComputeRunningProcesses``, whose
``usedGpuMemory`` NVML may leave unavailable: ``None``). Utilisation is not kept for a slice:
NVML gives it per GPU, not per instance, so it would be the neighbours' work too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class NvmlInfo:
    """Driver-side figures of one GPU, or the reason they could not be read. ``index`` is
    torch's CUDA index; ``uuid`` NVML's name of the device it found (``GPU-...`` or
    ``MIG-...``); ``mig`` whether that device is a MIG slice (then ``used`` and ``total`` are
    the slice's, and figures NVML cannot attribute to the slice are ``None``)."""

    available: bool
    reason: str | None = None
    index: int | None = None
    name: str | None = None
    used: int | None = None
    total: int | None = None
    process_used: int | None = None
    gpu_utilization: int | None = None
    memory_utilization: int | None = None
    uuid: str | None = None
    mig: bool = False


@dataclass(frozen=True)
class _Identity:
    """A CUDA device as torch names it: its index, UUID (bare hex, or with the ``GPU-`` or
    ``MIG-`` prefix a build may give) and PCI bus id (``None`` where torch does not say)."""

    index: int
    uuid: str | None
    bus_id: str | None


@dataclass(frozen=True)
class _Found:
    """The NVML handle of a CUDA device, NVML's UUID of it, and whether it is a MIG slice."""

    handle: Any
    uuid: str | None
    mig: bool


def _error_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.decode() if isinstance(text, bytes) else text


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _uuid_of(props: Any) -> str | None:
    """The UUID torch gives for a device, as text; ``None`` when it gives none (a build
    without the field) or an empty one (all zeros)."""
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    text = _text(raw).strip()
    bare = text[4:] if text[:4].upper() in ("GPU-", "MIG-") else text
    return text if bare.strip("0-") else None


def _bus_id_of(props: Any) -> str | None:
    """The PCI bus id NVML takes (``domain:bus:device.0``), from torch's PCI fields."""
    bus = getattr(props, "pci_bus_id", None)
    if not isinstance(bus, int) or isinstance(bus, bool):
        return None
    domain = getattr(props, "pci_domain_id", 0)
    device = getattr(props, "pci_device_id", 0)
    if not isinstance(domain, int) or not isinstance(device, int):
        return None
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def _identity(index: int, initialise: bool) -> _Identity | str:
    """How torch names ``cuda:index``, or why it cannot be asked (no CUDA, no such device,
    CUDA not started and ``initialise`` false: reading the properties would start it)."""
    try:
        if not initialise and not torch.cuda.is_initialized():
            return (f"CUDA was never initialised in this process, and memsentry does not start "
                    f"it to ask which GPU cuda:{index} is")
        if not torch.cuda.is_available():
            return (f"torch {torch.__version__} sees no CUDA device, so no NVML GPU can be "
                    f"matched to cuda:{index}")
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            return (f"torch has no cuda:{index} ({count} CUDA device(s) visible); NVML's GPU "
                    f"{index} would be another one")
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:
        return f"torch could not describe cuda:{index}: {_error_text(exc)}"
    return _Identity(index, _uuid_of(props), _bus_id_of(props))


def _candidates(uuid: str) -> tuple[str, ...]:
    """The NVML spellings of a UUID torch gave: as given when it carries NVML's prefix,
    else the whole GPU's (``GPU-``), then a MIG slice's (``MIG-``)."""
    prefix = uuid[:4].upper()
    if prefix in ("GPU-", "MIG-"):
        return (prefix + uuid[4:].lower(),)
    bare = uuid.lower()
    return (f"GPU-{bare}", f"MIG-{bare}")


def _bare(uuid: str) -> str:
    return uuid[4:].lower() if uuid[:4].upper() in ("GPU-", "MIG-") else uuid.lower()


def _is_mig_handle(pynvml: Any, handle: Any) -> bool:
    """Whether NVML says ``handle`` is a MIG device (pynvml returns a ctypes ``c_uint``)."""
    check = getattr(pynvml, "nvmlDeviceIsMigDeviceHandle", None)
    if check is None:
        return False
    try:
        answer = check(handle)
    except Exception:
        return False
    return bool(getattr(answer, "value", answer))


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    """Whether the GPU behind ``handle`` runs in MIG mode now (its current mode)."""
    try:
        current = pynvml.nvmlDeviceGetMigMode(handle)[0]
    except Exception:
        return False
    return bool(current == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1))


def _nvml_uuid(pynvml: Any, handle: Any) -> str | None:
    try:
        return _text(pynvml.nvmlDeviceGetUUID(handle))
    except Exception:
        return None


def _by_uuid(pynvml: Any, uuid: str, tried: list[str]) -> _Found | None:
    for candidate in _candidates(uuid):
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(candidate)
        except Exception as exc:
            tried.append(f"no device with UUID {candidate} ({_error_text(exc)})")
            continue
        mig = candidate.startswith("MIG-") or _is_mig_handle(pynvml, handle)
        return _Found(handle, candidate, mig)
    return None


def _by_pci(pynvml: Any, who: _Identity, bus_id: str) -> _Found | str:
    """The GPU at ``bus_id``, if it is surely ``who``: not in MIG mode (a bus id names the
    board, not which slice) and not carrying another device's UUID."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception as exc:
        return f"no GPU at PCI bus id {bus_id} ({_error_text(exc)})"
    if _mig_enabled(pynvml, handle):
        return (f"the GPU at PCI bus id {bus_id} is in MIG mode, and a bus id cannot say "
                f"which slice cuda:{who.index} is")
    uuid = _nvml_uuid(pynvml, handle)
    if who.uuid is not None and uuid is not None and _bare(uuid) != _bare(who.uuid):
        return f"the GPU at PCI bus id {bus_id} is {uuid}, not cuda:{who.index}'s {who.uuid}"
    return _Found(handle, uuid, False)


def _find(pynvml: Any, who: _Identity) -> _Found | str:
    """NVML's handle of the device torch calls ``cuda:<who.index>``, or why none is sure."""
    tried: list[str] = []
    if who.uuid is not None:
        found = _by_uuid(pynvml, who.uuid, tried)
        if found is not None:
            return found
    if who.bus_id is not None:
        answer = _by_pci(pynvml, who, who.bus_id)
        if isinstance(answer, _Found):
            return answer
        tried.append(answer)
    said = "; ".join(tried) or "torch gives neither its UUID nor its PCI bus id"
    return (f"NVML finds no GPU that is surely cuda:{who.index}: {said}. NVML's GPU "
            f"{who.index} may be another one (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so "
            "no figures are shown; a current NVIDIA driver and nvidia-ml-py find GPUs and MIG "
            "slices by UUID")


def query(index: int = 0, *, initialise: bool = True) -> NvmlInfo:
    """Read NVML's figures for CUDA device ``index``, found by its UUID: used and total
    memory, this process's memory on it, and utilisation (not for a MIG slice). Any failure
    gives ``available=False`` and the reason. With ``initialise=False`` a process that never
    initialised CUDA gets that reason instead of CUDA started on its behalf."""
    try:
        import pynvml
    except ImportError as exc:
        return NvmlInfo(False, f"the pynvml module is not installed ({_error_text(exc)}); "
                        "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return NvmlInfo(False, f"NVML could not start: {_error_text(exc)}")
    try:
        who = _identity(index, initialise)
        found = who if isinstance(who, str) else _find(pynvml, who)
        if isinstance(found, str):
            return NvmlInfo(False, found, index=index)
        return _figures(pynvml, index, found)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _figures(pynvml: Any, index: int, found: _Found) -> NvmlInfo:
    handle = found.handle
    values: dict[str, object] = {"available": True, "index": index, "uuid": found.uuid,
                                 "mig": found.mig}
    try:
        values["name"] = _text(pynvml.nvmlDeviceGetName(handle))
    except Exception:
        pass
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        values["used"], values["total"] = int(mem.used), int(mem.total)
    except Exception as exc:
        values["reason"] = f"memory figures unavailable: {_error_text(exc)}"
    if not found.mig:
        values.update(_utilisation(pynvml, handle))
    values["process_used"] = _process_memory(pynvml, handle)
    return NvmlInfo(**values)  # type: ignore[arg-type]


def _utilisation(pynvml: Any, handle: Any) -> dict[str, int]:
    try:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return {"gpu_utilization": int(rates.gpu), "memory_utilization": int(rates.memory)}
    except Exception:
        return {}


def _process_memory(pynvml: Any, handle: Any) -> int | None:
    """Device memory NVML attributes to this process, or ``None`` when it will not say."""
    pid = os.getpid()
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        func = getattr(pynvml, getter, None)
        if func is None:
            continue
        try:
            for proc in func(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:
            continue
    return None
