"""A stand-in for the CUDA calls of pytest_memsentry (its ``CudaApi``), so the plugin's CUDA
checks run on machines without a GPU. A test file "allocates" device memory with
``FAKE.alloc(...)``; the driver's used memory follows the allocator unless told otherwise.
The conftest of a pytester run hands ``FAKE`` to the plugin (see tests/test_plugin.py)."""

from __future__ import annotations

MiB = 1024 * 1024


class FakeCuda:
    def __init__(self, devices: int = 2) -> None:
        self.on = True
        self.allocated_ = dict.fromkeys(range(devices), 0)
        self.peak_ = dict.fromkeys(range(devices), 0)
        self.unseen = dict.fromkeys(range(devices), 0)  # driver minus allocator
        self.transient = dict.fromkeys(range(devices), 0)  # freed at the next settle()
        self.settles = 0

    # -- what tests do -------------------------------------------------------------------
    def alloc(self, size: int, device: int = 0, *, driver: bool = True) -> None:
        self.allocated_[device] += size
        self.peak_[device] = max(self.peak_[device], self.allocated_[device])
        if not driver:
            self.unseen[device] -= size

    def free(self, size: int, device: int = 0) -> None:
        self.allocated_[device] -= size

    def alloc_until_settled(self, size: int, device: int = 0) -> None:
        """Memory still in flight after the test, freed once the device synchronises."""
        self.alloc(size, device)
        self.transient[device] += size

    def driver_grows(self, size: int, device: int = 0) -> None:
        """Device memory outside the allocator (a context growing, a library's handle)."""
        self.unseen[device] += size

    # -- the plugin's CudaApi ------------------------------------------------------------
    def ready(self) -> bool:
        return self.on

    def devices(self) -> list[int]:
        return list(self.allocated_)

    def allocated(self, device: int) -> int:
        return self.allocated_[device]

    def driver_used(self, device: int) -> int:
        return 500 * MiB + self.allocated_[device] + self.unseen[device]

    def peak(self, device: int) -> int:
        return self.peak_[device]

    def reset_peak(self, device: int) -> None:
        self.peak_[device] = self.allocated_[device]

    def settle(self, devices: list[int]) -> None:
        self.settles += 1
        for device in devices:
            self.allocated_[device] -= self.transient[device]
            self.transient[device] = 0


FAKE = FakeCuda()
