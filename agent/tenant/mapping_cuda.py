"""GPU address space for the cuda backend: reserve once, import and map held fds, unmap."""

from __future__ import annotations

from typing import Any

from agent.errors import MappingError
from agent.holder.backends import BackendError
from agent.holder.backends.cuda import check


def checked(result: Any, what: str) -> Any:
    """cuda-bindings' `(CUresult, value...)` unwrapped; a failure as MappingError."""
    try:
        return check(result, what)
    except BackendError as e:
        raise MappingError(str(e)) from e


class CudaSpace:
    """A VA range reserved with cuMemAddressReserve; held allocations are imported into it.

    Detach unmaps and releases the imported handles but keeps the reservation: LAB fact 12,
    imported memory still mapped at checkpoint time makes the restore fail for good, and
    the same addresses must come back so tensors and captured CUDA graphs stay valid.
    Every call binds the device's primary context (the one torch uses) first.

    Example::

        space = CudaSpace(total, align=granularity, device=torch.cuda.current_device())
        space.map(0, grant.fds, grant.region.chunks)
        w = space.tensor(0, grant.region.size)

    `driver` is cuda-bindings' driver module (the default), or a fake of it in tests.
    """

    def __init__(self, size: int, align: int, device: int, driver: Any = None) -> None:
        if driver is None:
            from cuda.bindings import driver

        cu = self._cu = driver
        self.align = align
        self.size = -(-size // align) * align
        self.device = device
        self._handles: dict[int, tuple[Any, int]] = {}  # offset of a chunk -> its imported handle
        # The device's primary context: the one torch uses. Calls may come from another
        # thread (the engine's prepare/resume run off its event loop), where no context is
        # current, so every call binds it first.
        checked(cu.cuInit(0), "cuInit")
        dev = checked(cu.cuDeviceGet(device), f"cuDeviceGet({device})")
        self._dev = dev
        self._ctx = checked(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._bind()
        self.base = int(checked(cu.cuMemAddressReserve(self.size, align, 0, 0),
                            f"cuMemAddressReserve({self.size})"))
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = acc

    def _bind(self) -> None:
        checked(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def map(self, offset: int, fds: list[int], chunks: list[int]) -> None:
        cu = self._cu
        self._bind()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        at = offset
        for fd, length in zip(fds, chunks, strict=True):
            if at < 0 or at + length > self.size or at % self.align:
                raise MappingError(f"{length} bytes at offset {at} do not fit the reserved "
                                   f"{self.size} bytes at {self.base:#x}")
            # The import takes its own reference; the fd itself can be closed right after.
            h = checked(cu.cuMemImportFromShareableHandle(fd, kind),
                    "cuMemImportFromShareableHandle")
            self._place(at, length, h)
            at += length

    def create(self, offset: int, length: int) -> None:
        """Back [offset, offset + length) with new memory of this process's own (no handle
        to share): memory that can be dropped before a checkpoint and made again at the
        same addresses after it, e.g. a KV pool that captured CUDA graphs point into."""
        cu = self._cu
        self._bind()
        if offset < 0 or offset + length > self.size or offset % self.align or length % self.align:
            raise MappingError(f"{length} bytes at offset {offset} do not fit the reserved "
                               f"{self.size} bytes at {self.base:#x} in {self.align}-byte units")
        h = checked(cu.cuMemCreate(length, local_prop(self.device), 0), f"cuMemCreate({length})")
        self._place(offset, length, h)

    def _place(self, at: int, length: int, h: Any) -> None:
        """Map the handle `h` at offset `at` and own it (released if it cannot be mapped)."""
        cu = self._cu
        try:
            checked(cu.cuMemMap(self.base + at, length, 0, h, 0), "cuMemMap")
        except MappingError:
            checked(cu.cuMemRelease(h), "cuMemRelease")
            raise
        self._handles[at] = (h, length)
        checked(cu.cuMemSetAccess(self.base + at, length, [self._access], 1), "cuMemSetAccess")

    def unmap(self, offset: int, length: int) -> None:
        cu = self._cu
        self._bind()
        # Kernels still reading the weights must finish before the pages go.
        checked(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        for at in sorted(a for a in self._handles if offset <= a < offset + length):
            h, size = self._handles.pop(at)
            checked(cu.cuMemUnmap(self.base + at, size), "cuMemUnmap")
            checked(cu.cuMemRelease(h), "cuMemRelease")

    def tensor(self, offset: int, length: int) -> Any:
        import torch

        ptr = self.base + offset

        class _View:
            __cuda_array_interface__ = {"shape": (length,), "typestr": "|u1",
                                        "data": (ptr, False), "version": 3}

        return torch.as_tensor(_View(), device=f"cuda:{self.device}")

    def close(self) -> None:
        if not self.size:
            return
        self.unmap(0, self.size)
        checked(self._cu.cuMemAddressFree(self.base, self.size), "cuMemAddressFree")
        self.size = 0
        checked(self._cu.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")


def local_prop(device: int) -> Any:
    """Allocation properties of plain device memory on `device`, shared with nobody."""
    from cuda.bindings import driver as cu

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def local_granularity(device: int) -> int:
    from cuda.bindings import driver as cu

    checked(cu.cuInit(0), "cuInit")
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(checked(cu.cuMemGetAllocationGranularity(local_prop(device), flag),
                   "cuMemGetAllocationGranularity"))


def cuda_space_factory(device: int) -> Any:
    """A `make_space(total, align)` for HeldSet that reserves on `device`."""

    def make(total: int, align: int) -> CudaSpace:
        return CudaSpace(total, align=align, device=device)

    return make
