"""A fake of the CUDA driver calls the holder's refill makes (cuda-bindings' shapes), with
asynchronous streams: a copy reads its host buffer only when its stream is synchronized,
so a loader that reuses a pinned buffer too early writes the wrong bytes, as on a GPU."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
from collections import Counter
from enum import IntEnum
from types import SimpleNamespace
from typing import Any

OK = 0


class CUresult(IntEnum):
    """The failures this fake returns, named as cuda-bindings names them."""

    CUDA_ERROR_OUT_OF_MEMORY = 2


class FakeCuda:
    """`cuda.bindings.driver` for `CudaSink(..., driver=FakeCuda())`; device memory is one
    bytearray per handle (a chunk), mapped at the addresses `cuMemAddressReserve` gave."""

    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._next_va = 1 << 40
        self.maps: dict[int, bytearray] = {}        # address -> the chunk mapped there
        self.host: dict[int, ctypes.Array] = {}     # pinned buffers by address
        self.streams: dict[int, list[tuple]] = {}   # stream -> queued work
        self.events: dict[int, int | None] = {}     # event -> the stream it was recorded on
        self.live = Counter()                       # what is allocated now, by kind
        self.current: dict[int, int] = {}           # thread -> its current context (0: none)
        self.host_flags: list[int] = []             # cuMemHostAlloc's flags, call by call
        self.host_alloc_fails_after: int | None = None  # then CUDA_ERROR_OUT_OF_MEMORY
        self.registered: dict[int, int] = {}        # cuMemHostRegister'ed: address -> bytes
        self.registrations = 0
        self.copied_dtoh = 0                        # bytes cuMemcpyDtoH moved

    def cuInit(self, flags: int):  # noqa: N802
        return (OK,)

    def cuMemImportFromShareableHandle(self, fd: int, kind: int):  # noqa: N802
        """A holder's exported chunk: here a memfd, mapped shared, so the "device memory"
        is the holder's own bytes."""
        assert kind == self.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.live["imported"] += 1
        return OK, mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)

    def cuMemGetAllocationPropertiesFromHandle(self, handle: Any):  # noqa: N802
        return OK, SimpleNamespace(location=SimpleNamespace(type=1, id=0))

    def cuMemRelease(self, handle: Any):  # noqa: N802
        if isinstance(handle, mmap.mmap):
            handle.close()
            self.live["imported"] -= 1
        return (OK,)

    def cuCtxSynchronize(self):  # noqa: N802
        return (OK,)

    def cuMemcpyDtoH(self, dst: int, src: int, n: int):  # noqa: N802
        """Synchronous: device bytes at `src` into host memory at `dst`, which must be
        pinned (a pageable destination would be legal, but not what the reader means)."""
        assert self._host_memory(dst, n), f"a copy to {dst:#x}, neither pinned nor registered"
        data = self._read(src, n)
        ctypes.memmove(dst, data, n)
        self.copied_dtoh += n
        return (OK,)

    @staticmethod
    def CUmemAccessDesc() -> Any:  # noqa: N802 - the driver's name
        return SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None)

    def cuDeviceGet(self, ordinal: int):  # noqa: N802
        return OK, ordinal

    def cuDevicePrimaryCtxRetain(self, dev: int):  # noqa: N802
        self.live["ctx"] += 1
        return OK, 1000 + dev

    def cuDevicePrimaryCtxRelease(self, dev: int):  # noqa: N802
        self.live["ctx"] -= 1
        return (OK,)

    def cuCtxSetCurrent(self, ctx: int):  # noqa: N802
        self.current[threading.get_ident()] = ctx
        return (OK,)

    def cuCtxGetCurrent(self):  # noqa: N802
        return OK, self.current.get(threading.get_ident(), 0)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int):  # noqa: N802
        base = self._next_va
        self._next_va += -(-size // align) * align + align
        self.live["va"] += 1
        return OK, base

    def cuMemAddressFree(self, base: int, size: int):  # noqa: N802
        self.live["va"] -= 1
        return (OK,)

    def cuMemMap(self, addr: int, length: int, offset: int, handle: Any, flags: int):  # noqa: N802
        assert len(handle) == length
        self.maps[addr] = handle
        return (OK,)

    def cuMemUnmap(self, addr: int, length: int):  # noqa: N802
        del self.maps[addr]
        return (OK,)

    def cuMemSetAccess(self, addr: int, size: int, descs: list, count: int):  # noqa: N802
        return (OK,)

    def cuStreamCreate(self, flags: int):  # noqa: N802
        s = next(self._ids)
        self.streams[s] = []
        self.live["stream"] += 1
        return OK, s

    def cuStreamDestroy(self, s: int):  # noqa: N802
        assert not self.streams.pop(s), "a stream destroyed with work queued"
        self.live["stream"] -= 1
        return (OK,)

    def cuEventCreate(self, flags: int):  # noqa: N802
        e = next(self._ids)
        self.events[e] = None
        self.live["event"] += 1
        return OK, e

    def cuEventDestroy(self, e: int):  # noqa: N802
        del self.events[e]
        self.live["event"] -= 1
        return (OK,)

    def cuMemHostAlloc(self, n: int, flags: int):  # noqa: N802
        if self.host_alloc_fails_after is not None and \
                len(self.host_flags) >= self.host_alloc_fails_after:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        self.host_flags.append(flags)
        buf = (ctypes.c_char * n)()
        self.host[ctypes.addressof(buf)] = buf
        self.live["pinned"] += 1
        return OK, ctypes.addressof(buf)

    def cuMemFreeHost(self, ptr: int):  # noqa: N802
        del self.host[ptr]
        self.live["pinned"] -= 1
        return (OK,)

    def cuMemHostRegister(self, ptr: int, n: int, flags: int):  # noqa: N802
        assert ptr % 4096 == 0 and n % 4096 == 0, "a registration of whole pages"
        for at, k in self.registered.items():
            if at < ptr + n and ptr < at + k:  # the driver's HOST_MEMORY_ALREADY_REGISTERED
                raise AssertionError(f"{ptr:#x}+{n} overlaps the registration {at:#x}+{k}")
        self.registered[ptr] = n
        self.registrations += 1
        self.live["registered"] += 1
        return (OK,)

    def cuMemHostUnregister(self, ptr: int):  # noqa: N802
        del self.registered[ptr]
        self.live["registered"] -= 1
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        self.streams[stream].append(("copy", dst, src, n))
        return (OK,)

    def cuMemcpyHtoD(self, dst: int, src: int, n: int):  # noqa: N802
        self._write(dst, ctypes.string_at(src, n))
        return (OK,)

    def cuMemsetD8Async(self, dst: int, value: int, n: int, stream: int):  # noqa: N802
        self.streams[stream].append(("set", dst, value, n))
        return (OK,)

    def cuEventRecord(self, e: int, stream: int):  # noqa: N802
        self.events[e] = stream
        self.streams[stream].append(("event", e))
        return (OK,)

    def cuEventSynchronize(self, e: int):  # noqa: N802
        s = self.events[e]
        if s is not None:
            self._run(s, until=e)
        return (OK,)

    def cuStreamSynchronize(self, s: int):  # noqa: N802
        self._run(s, until=None)
        return (OK,)

    def _run(self, s: int, until: int | None) -> None:
        q = self.streams[s]
        while q:
            op = q.pop(0)
            if op[0] == "event":
                if op[1] == until:
                    return
                continue
            if op[0] == "set":
                self._write(op[1], bytes([op[2]]) * op[3])
                continue
            _, dst, src, n = op
            assert self._host_memory(src, n), f"a copy from {src:#x}, neither pinned nor registered"
            self._write(dst, ctypes.string_at(src, n))

    def _host_memory(self, src: int, n: int) -> bool:
        ranges = [*((a, len(b)) for a, b in self.host.items()), *self.registered.items()]
        return any(a <= src and src + n <= a + k for a, k in ranges)

    def _read(self, src: int, n: int) -> bytes:
        out = bytearray(n)
        done = 0
        for base in sorted(self.maps):
            chunk = self.maps[base]
            lo, hi = max(src, base), min(src + n, base + len(chunk))
            if lo < hi:
                out[lo - src:hi - src] = chunk[lo - base:hi - base]
                done += hi - lo
        assert done == n, f"a copy from {src:#x} of {n} bytes left the mappings"
        return bytes(out)

    def _write(self, dst: int, data: bytes) -> None:
        done = 0
        for base in sorted(self.maps):
            chunk = self.maps[base]
            lo, hi = max(dst + done, base), min(dst + len(data), base + len(chunk))
            if lo < hi:
                chunk[lo - base:hi - base] = data[lo - dst:hi - dst]
                done = hi - dst
        assert done == len(data), f"a copy to {dst:#x} of {len(data)} bytes left the mappings"
