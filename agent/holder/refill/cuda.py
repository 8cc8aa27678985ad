"""The cuda backend's refill sink: pinned host buffers, then asynchronous copies per stream."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.holder.backends import Allocation, BackendError
from agent.holder.refill import DEFAULT_TUNING, PAGE, Host, Tuning, pread_into
from agent.holder.refill.libc import HUGE, advise_huge_pages, mmap_address, munmap

# cuda.h's CU_MEMHOSTALLOC_WRITECOMBINED, for bindings that do not name it.
WRITECOMBINED = 0x04
# cuda.h's CU_MEMHOSTREGISTER_READ_ONLY: the pages are a read-only mapping of the file.
REGISTER_READ_ONLY = 0x08


@dataclass
class _Lane:
    """One worker thread's stream and its slots (cuda): each slot a pinned buffer (or, when
    direct, a registered range of a file's pages) and the event of its last copy."""

    stream: Any
    buffers: list[int] = field(default_factory=list)      # cuMemHostAlloc'ed, to free
    pinned: list[int] = field(default_factory=list)       # cuMemHostRegister'ed, to unregister
    anonymous: list[tuple[int, int]] = field(default_factory=list)  # mmap'ed, to munmap
    address: list[int] = field(default_factory=list)      # each slot's buffer
    views: list[memoryview] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    registered: list[int | None] = field(default_factory=list)
    turn: int = 0


class CudaSink:
    """CUDA VMM regions, mapped into a VA range of the holder's for the load.

    The holder serves without a CUDA context (it only creates and exports allocations),
    but copies need one: the device's primary context is retained for the load and
    released right after, so an idle holder costs no context memory on the GPU. Making
    that context and the pinned buffers takes a while, so it starts on a thread of its own
    when the sink is made, while the server creates the regions (cuMemCreate needs no
    context); `open` waits for it, then maps the regions.

    `Host.DIRECT`: no buffers; the files are mapped here and each piece's page-cache pages
    are registered (cuMemHostRegister, read-only) and copied from where they are; a range
    is unregistered once its copy has landed.

    Example::

        sink = CudaSink(backend, tuning)    # the context and buffers are being made
        sink.open(allocations)              # on the job's thread: waits for them, maps
        sink.write(0, 0, fd, offset, n); sink.finish(); sink.close()
    """

    def __init__(self, backend: Any, tuning: Tuning = DEFAULT_TUNING, driver: Any = None) -> None:
        from agent.holder.backends.cuda import check

        if driver is None:
            from cuda.bindings import driver
        self._cu, self._check = driver, check
        self._ordinal, self._align = backend.ordinal, backend.align
        self._tuning = tuning
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []   # every lane made, for close
        self._free: list[_Lane] = []    # lanes no worker thread has taken yet
        self._local = threading.local()
        self._bases: list[tuple[int, int, list[int]]] = []  # (base, size, chunk sizes)
        self._files: dict[int, tuple[int, int]] = {}        # fd -> (address, length) mapped
        self._dev: Any = None
        self._ctx: Any = None
        self._prep_error: BaseException | None = None
        self.timings: dict[str, float] = {}
        self._prep = threading.Thread(target=self._prepare, name="refill-prepare", daemon=True)
        self._prep.start()

    def _prepare(self) -> None:
        cu, check = self._cu, self._check
        t0 = time.monotonic()
        try:
            self._dev = check(cu.cuDeviceGet(self._ordinal), "cuDeviceGet")
            self._ctx = check(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self.timings["context_s"] = time.monotonic() - t0
            t1 = time.monotonic()
            for _ in range(self._tuning.threads):
                self._free.append(self._new_lane())
            self.timings["pinned_s"] = time.monotonic() - t1
        except BaseException as e:  # noqa: BLE001 - handed to the job's thread by open()
            self._prep_error = e

    def _new_lane(self) -> _Lane:
        """A stream and its slots: a buffer (unless direct) and an event each."""
        cu, check = self._cu, self._check
        stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                       "cuStreamCreate")
        lane = _Lane(stream=stream)
        self._lanes.append(lane)  # before its slots: close() frees what was made
        for _ in range(self._tuning.buffers):
            if self._tuning.host is not Host.DIRECT:
                buf = self._buffer(lane)
                lane.address.append(buf)
                lane.views.append(memoryview(
                    (ctypes.c_char * self._tuning.piece).from_address(buf)).cast("B"))
            lane.registered.append(None)
            lane.events.append(check(cu.cuEventCreate(
                int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate"))
        return lane

    def _buffer(self, lane: _Lane) -> int:
        """One host buffer of a piece for `lane`, pinned as the tuning says; its address."""
        cu, check, n = self._cu, self._check, self._tuning.piece
        if self._tuning.host is Host.HUGE_PAGES:
            # Over-allocated by a huge page so the buffer can start on one.
            length = n + HUGE
            base = mmap_address(length, -1, mmap.PROT_READ | mmap.PROT_WRITE,
                                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            lane.anonymous.append((base, length))
            buf = -(-base // HUGE) * HUGE
            advise_huge_pages(buf, n)
            check(cu.cuMemHostRegister(buf, n, 0), "cuMemHostRegister")
            lane.pinned.append(buf)
            return buf
        wc = self._tuning.host is Host.WRITE_COMBINED
        flags = int(getattr(cu, "CU_MEMHOSTALLOC_WRITECOMBINED", WRITECOMBINED)) if wc else 0
        buf = int(check(cu.cuMemHostAlloc(n, flags), "cuMemHostAlloc"))
        lane.buffers.append(buf)
        return buf

    def open(self, allocations: list[Allocation]) -> None:
        cu, check = self._cu, self._check
        t0 = time.monotonic()
        self._prep.join()
        self.timings["waited_s"] = time.monotonic() - t0
        if self._prep_error is not None:
            raise self._prep_error
        t1 = time.monotonic()
        check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = self._ordinal
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for a in allocations:
            base = int(check(cu.cuMemAddressReserve(a.size, self._align, 0, 0),
                             "cuMemAddressReserve"))
            self._bases.append((base, a.size, []))
            at = 0
            for h, length in zip(a.handle, a.chunks, strict=True):
                check(cu.cuMemMap(base + at, length, 0, h, 0), "cuMemMap")
                self._bases[-1][2].append(length)
                at += length
            check(cu.cuMemSetAccess(base, a.size, [acc], 1), "cuMemSetAccess")
        self.timings["map_s"] = time.monotonic() - t1

    def _lane(self) -> _Lane:
        lane = getattr(self._local, "lane", None)
        if lane is not None:
            return lane
        check = self._check
        check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        with self._lock:
            if not self._free:
                raise BackendError(f"more refill threads than the {len(self._lanes)} lanes "
                                   "made for them")
            lane = self._free.pop()
        self._local.lane = lane
        return lane

    def _mapped(self, fd: int) -> int:
        """The address of `fd`'s file mapped here, read-only (direct)."""
        with self._lock:
            if fd not in self._files:
                length = os.fstat(fd).st_size
                addr = mmap_address(length, fd)
                self._files[fd] = (addr, length)
            return self._files[fd][0]

    def write(self, region: int, offset: int, fd: int, file_offset: int, length: int) -> None:
        cu, check = self._cu, self._check
        lane = self._lane()
        dst = self._bases[region][0] + offset
        piece = self._tuning.piece
        direct = self._tuning.host is Host.DIRECT
        file_at = self._mapped(fd) if direct else 0
        done = 0
        while done < length:
            n = min(piece, length - done)
            b = lane.turn
            lane.turn = (b + 1) % len(lane.events)
            # This slot's last copy must be done before it is refilled (or unregistered),
            # while the copies of the lane's other slots may still run.
            check(cu.cuEventSynchronize(lane.events[b]), "cuEventSynchronize")
            if direct:
                self._unregister(lane, b)
                src = file_at + file_offset + done
                lo, hi = src - src % PAGE, -(-(src + n) // PAGE) * PAGE
                check(cu.cuMemHostRegister(lo, hi - lo, REGISTER_READ_ONLY),
                      "cuMemHostRegister")
                lane.registered[b] = lo
            else:
                view = lane.views[b]
                pread_into(fd, view[:n], file_offset + done)
                src = lane.address[b]
            check(cu.cuMemcpyHtoDAsync(dst + done, src, n, lane.stream), "cuMemcpyHtoDAsync")
            check(cu.cuEventRecord(lane.events[b], lane.stream), "cuEventRecord")
            done += n

    def put(self, region: int, offset: int, data: bytes) -> None:
        # Rare (a cast tensor) and small: a synchronous copy from pageable memory, which
        # works in every host mode (direct has no buffers of its own).
        self._lane()
        buf = ctypes.create_string_buffer(data, len(data))
        self._check(self._cu.cuMemcpyHtoD(self._bases[region][0] + offset,
                                          ctypes.addressof(buf), len(data)), "cuMemcpyHtoD")

    def zero(self, region: int, offset: int, length: int) -> None:
        # cuMemCreate'd memory holds whatever it held: the gaps are set, on the lane's stream.
        lane = self._lane()
        self._check(self._cu.cuMemsetD8Async(self._bases[region][0] + offset, 0, length,
                                             lane.stream), "cuMemsetD8Async")

    def _unregister(self, lane: _Lane, b: int) -> None:
        at = lane.registered[b]
        if at is not None:
            lane.registered[b] = None
            self._check(self._cu.cuMemHostUnregister(at), "cuMemHostUnregister")

    def finish(self) -> None:
        cu, check = self._cu, self._check
        check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        for lane in self._lanes:
            check(cu.cuStreamSynchronize(lane.stream), "cuStreamSynchronize")
            for b in range(len(lane.registered)):
                self._unregister(lane, b)

    def close(self) -> None:
        """Give back everything the sink made, whatever fails on the way: BackendError
        naming every call that failed, once all were tried."""
        cu = self._cu
        self._prep.join()
        errors: list[str] = []

        def attempt(result: Any, what: str) -> None:
            try:
                self._check(result, what)
            except BackendError as e:
                errors.append(str(e))

        # close() may run on any thread (the server's loop discards a sink made ahead): the
        # context that thread had current is put back after, not left at one released here.
        previous = None
        if self._ctx is not None:
            err, previous = cu.cuCtxGetCurrent()
            attempt((err,), "cuCtxGetCurrent")
            attempt(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        for lane in self._lanes:
            self._close_lane(lane, attempt)
        self._lanes.clear()
        self._free.clear()
        for addr, length in self._files.values():
            munmap(addr, length)
        self._files.clear()
        self._unmap_regions(attempt)
        if self._ctx is not None:
            attempt(cu.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
            self._ctx = None
            attempt(cu.cuCtxSetCurrent(previous), "cuCtxSetCurrent")
        if errors:
            raise BackendError("after the refill: " + "; ".join(errors))

    def _close_lane(self, lane: _Lane, attempt: Callable[[Any, str], None]) -> None:
        cu = self._cu
        attempt(cu.cuStreamSynchronize(lane.stream), "cuStreamSynchronize")
        for at in lane.registered:
            if at is not None:
                attempt(cu.cuMemHostUnregister(at), "cuMemHostUnregister")
        for view in lane.views:
            view.release()
        for buf in lane.buffers:
            attempt(cu.cuMemFreeHost(buf), "cuMemFreeHost")
        for buf in lane.pinned:
            attempt(cu.cuMemHostUnregister(buf), "cuMemHostUnregister")
        for base, length in lane.anonymous:
            munmap(base, length)
        for ev in lane.events:
            attempt(cu.cuEventDestroy(ev), "cuEventDestroy")
        attempt(cu.cuStreamDestroy(lane.stream), "cuStreamDestroy")

    def _unmap_regions(self, attempt: Callable[[Any, str], None]) -> None:
        cu = self._cu
        for base, size, chunks in self._bases:
            at = 0
            for length in chunks:
                attempt(cu.cuMemUnmap(base + at, length), "cuMemUnmap")
                at += length
            attempt(cu.cuMemAddressFree(base, size), "cuMemAddressFree")
        self._bases.clear()
