"""Which devices memsentry can measure, and turning a ``device=`` argument into one."""

from __future__ import annotations

import torch

from memsentry.errors import UnsupportedDeviceError
from memsentry.measure.accelerator import accelerator_type

#: Device types with a dedicated backend; the process's ``torch.accelerator`` type is added.
DEDICATED_DEVICE_TYPES = ("cpu", "cuda")


def supported_device_types() -> tuple[str, ...]:
    """``cpu``, ``cuda``, and this process's other accelerator (``xpu``, ``mps``, ...) if any."""
    other = accelerator_type()
    if other is None or other in DEDICATED_DEVICE_TYPES:
        return DEDICATED_DEVICE_TYPES
    return (*DEDICATED_DEVICE_TYPES, other)


def parse_device(device: object) -> torch.device:
    """Turn a ``device=`` argument into a ``torch.device`` memsentry can measure, or say why not."""
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise UnsupportedDeviceError(
                f"device={device}: a CUDA device index cannot be negative; use 0, 1, ... or 'cpu'"
            )
        parsed = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError as exc:
            raise UnsupportedDeviceError(
                f"device={device!r} is not a device name torch understands ({exc}); "
                "use 'cpu', 'cuda' or 'cuda:N'"
            ) from None
    else:
        raise TypeError(
            f"device must be a torch.device, a string such as 'cuda:0', or an int, "
            f"got {type(device).__name__}"
        )
    check_supported(parsed, f"device={str(device)!r}")
    return parsed


def check_supported(device: torch.device, origin: str) -> None:
    """Raise :class:`UnsupportedDeviceError` when ``device`` cannot be measured here."""
    # The CPU and CUDA need no question to torch.accelerator, which asks the driver for a
    # device count on a CUDA build (a program on the CPU then could not fork CUDA children).
    supported: tuple[str, ...] = DEDICATED_DEVICE_TYPES
    if device.type not in supported:
        supported = supported_device_types()
    if device.type not in supported:
        names = ", ".join(repr(t) for t in supported)
        raise UnsupportedDeviceError(
            f"{origin} is on {device.type!r}, which memsentry cannot measure in this process: "
            f"it measures {names} memory. Move the model with .to('cpu') or .to('cuda') while "
            "tracking, or pass device='cpu' / device='cuda' explicitly."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedDeviceError(
                f"{origin} is on CUDA, but CUDA is not available in this process "
                f"(torch {torch.__version__}); track on 'cpu' or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UnsupportedDeviceError(
                f"{origin}: there is no CUDA device {device.index}; this machine has {count} "
                f"(cuda:0 .. cuda:{count - 1})"
            )


def device_of_module(module: torch.nn.Module) -> torch.device | None:
    """The device of a module's first parameter or buffer (``None`` when it has neither).

    A model spread over several devices is measured on the device of its first parameter.
    """
    for parameter in module.parameters():
        return _checked_tensor_device(parameter, module)
    for buffer in module.buffers():
        return _checked_tensor_device(buffer, module)
    return None


def _checked_tensor_device(tensor: torch.Tensor, module: torch.nn.Module) -> torch.device:
    check_supported(tensor.device, f"model {type(module).__name__!r} ({tensor.device})")
    return tensor.device
