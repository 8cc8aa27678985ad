"""The cuda backend: CUDA VMM allocations (cuMemCreate) exported as POSIX fds."""

from __future__ import annotations

import logging
import os
from typing import Any

from agent.holder.backends.base import Allocation, BackendError, GpuFaultError

log = logging.getLogger("pitstop.holder.cuda")

# Big regions are split: one huge cuMemCreate fails on a fragmented GPU sooner than
# several 1 GiB ones, and LAB fact 11 measured 1 GiB chunks.
MAX_CHUNK = 1 << 30

# Results that mean the GPU itself is in trouble (Xid, ECC, a lost device): memory the
# holder owns may be corrupt, so the holder stops instead of handing it out.
FAULT_RESULTS = frozenset({
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_UNKNOWN",
    "CUDA_ERROR_DEVICE_UNAVAILABLE",
    "CUDA_ERROR_NVLINK_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    "CUDA_ERROR_SYSTEM_NOT_READY",
    "CUDA_ERROR_DEVICE_NOT_LICENSED",
})
OOM_RESULTS = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})


def result_name(err: Any) -> str:
    return str(getattr(err, "name", err))


def check(result: Any, what: str) -> Any:
    """Unwrap a cuda-bindings `(CUresult, value...)` tuple; raise a typed error on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = result_name(err)
        if name in FAULT_RESULTS:
            raise GpuFaultError(f"{what}: {name}; the GPU may have faulted (see dmesg for Xid); "
                                "held memory is no longer trusted, restart the holder")
        if name in OOM_RESULTS:
            raise BackendError(f"{what}: {name}; free GPU memory (pitstop holder release) "
                               "or lower what is held")
        raise BackendError(f"{what}: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def round_up(size: int, granularity: int) -> int:
    return -(-size // granularity) * granularity


def plan_chunks(size: int, granularity: int, max_chunk: int = MAX_CHUNK) -> list[int]:
    """Chunk sizes for a region of `size` bytes: each a multiple of the granularity."""
    if size <= 0 or granularity <= 0:
        raise ValueError(f"size {size} and granularity {granularity} must be positive")
    step = max(granularity, max_chunk // granularity * granularity)
    total = round_up(size, granularity)
    chunks = [step] * (total // step)
    if total % step:
        chunks.append(total % step)
    return chunks


def format_uuid(raw: bytes) -> str:
    """CUuuid's 16 bytes as nvidia-smi prints them: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _uuid_bytes(uuid_obj: Any) -> bytes:
    raw = uuid_obj.bytes
    if isinstance(raw, str):  # some releases hand back a str of 16 chars
        raw = raw.encode("latin-1")
    return bytes(raw)


class CudaBackend:
    """VMM allocations on one GPU, found by UUID.

    Creating and exporting allocations needs no CUDA context (cuMemCreate works without
    one on current drivers); a refill does, for its copies, and holds one only while it
    loads (agent/holder/refill/).
    """

    name = "cuda"

    def __init__(self, gpu: str) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            raise BackendError("the cuda backend needs cuda-bindings: pip install "
                               "'pitstop[cuda]' (or cuda-bindings matching the driver)") from e
        self._cu = cu
        self.gpu = gpu
        try:
            check(cu.cuInit(0), "cuInit")
        except BackendError:
            raise
        except Exception as e:  # cuda-bindings raises its own error when libcuda is absent
            raise BackendError(f"cuInit: {e}; is the NVIDIA driver installed?") from e
        self._ordinal = self._find(gpu)
        self._handle_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop = self._allocation_prop()
        self.align = int(check(cu.cuMemGetAllocationGranularity(
            self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self._ctx: Any = None

    @property
    def ordinal(self) -> int:
        """The device's index in this process (what cuDeviceGet takes)."""
        return self._ordinal

    def _find(self, gpu: str) -> int:
        cu = self._cu
        count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        seen = []
        for i in range(count):
            dev = check(cu.cuDeviceGet(i), f"cuDeviceGet({i})")
            uuid = format_uuid(_uuid_bytes(check(get_uuid(dev), f"cuDeviceGetUuid({i})")))
            if uuid.lower() == gpu.lower():
                return i
            seen.append(uuid)
        raise BackendError(f"no GPU with UUID {gpu}; this host has {', '.join(seen) or 'none'} "
                           "(nvidia-smi -L lists them)")

    def _allocation_prop(self) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._ordinal
        prop.requestedHandleTypes = self._handle_type
        return prop

    def _create(self, size: int) -> Any:
        cu = self._cu
        err, *rest = cu.cuMemCreate(size, self._prop, 0)
        if result_name(err) == "CUDA_ERROR_INVALID_CONTEXT" and self._ctx is None:
            # Drivers that want a context for VMM calls get the primary one, once; it
            # costs some GPU memory, so it is taken only when asked for.
            log.warning("the driver wants a CUDA context for cuMemCreate; retaining the "
                        "primary context of device %d", self._ordinal)
            dev = check(cu.cuDeviceGet(self._ordinal), "cuDeviceGet")
            self._ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            err, *rest = cu.cuMemCreate(size, self._prop, 0)
        return check((err, *rest), f"cuMemCreate({size})")

    def allocate(self, name: str, size: int) -> Allocation:
        cu = self._cu
        handles: list[Any] = []
        fds: list[int] = []
        chunks = plan_chunks(size, self.align)
        try:
            for chunk in chunks:
                h = self._create(chunk)
                handles.append(h)
                fds.append(int(check(cu.cuMemExportToShareableHandle(
                    h, self._handle_type, 0), "cuMemExportToShareableHandle")))
        except BaseException:
            self._free(handles, fds)
            raise
        return Allocation(fds=fds, chunks=chunks, handle=handles)

    def _free(self, handles: list[Any], fds: list[int]) -> None:
        # The physical memory goes back once every importer has released it too.
        errors = []
        for fd in fds:
            try:
                os.close(fd)
            except OSError as e:
                errors.append(f"close({fd}): {e.strerror}")
        for h in handles:
            try:
                check(self._cu.cuMemRelease(h), "cuMemRelease")
            except BackendError as e:
                errors.append(str(e))
        fds.clear()
        handles.clear()
        if errors:
            raise BackendError("; ".join(errors))

    def free(self, allocation: Allocation) -> None:
        handles = allocation.handle if isinstance(allocation.handle, list) else []
        self._free(handles, allocation.fds)

    def close(self) -> None:
        if self._ctx is not None:
            dev = check(self._cu.cuDeviceGet(self._ordinal), "cuDeviceGet")
            check(self._cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
            self._ctx = None
