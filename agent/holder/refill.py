"""The holder's refill: load a model's weights from its files into uncommitted regions.

The server creates the regions (uncommitted, so no tenant can attach them), runs a
`RefillJob` on a thread of its own, and commits every region at once on its loop when the
job ends well. Reads run on several threads at once; each piece goes straight into the
region (cpu: the memfd mapped here) or through pinned host buffers and asynchronous
host-to-device copies on a stream per thread, so the next read overlaps the copy (cuda).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agent.holder.backends import Allocation, Backend, BackendError, GpuFaultError
from agent.holder.protocol import ErrorCode
from agent.holder.weightplan import PlanRegion, RefillPlan
from agent.weights import stat_key

log = logging.getLogger("pitstop.holder.refill")

# Reads in flight: page cache and NVMe both want several to reach their rate, and each
# thread holds two pieces of pinned memory on the cuda backend.
DEFAULT_THREADS = min(8, os.cpu_count() or 1)
# One read (and on cuda one host-to-device copy): large enough that per-call costs vanish,
# small enough that 2 x threads of them stay a modest amount of pinned memory.
PIECE = 16 << 20


class RefillFailure(Exception):
    """A refill that cannot complete; `code` is what the waiting clients are told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Sink(Protocol):
    """Where a refill's bytes go: regions of one backend, written from worker threads."""

    def write(self, region: int, offset: int, fd: int, file_offset: int, length: int) -> None:
        """Read `length` bytes of `fd` at `file_offset` into region `region` at `offset`."""
        ...

    def finish(self) -> None:
        """Wait until every write has landed (copies still in flight on cuda)."""
        ...

    def close(self) -> None:
        ...


def pread_into(fd: int, view: memoryview, file_offset: int) -> None:
    """Fill `view` from `fd` at `file_offset`; a file shorter than that is a RefillFailure."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], file_offset + done)
        if got == 0:
            raise RefillFailure(ErrorCode.REFILL_FAILED, f"the file ended {len(view) - done} "
                                f"bytes early at offset {file_offset + done}")
        done += got


class CpuSink:
    """memfd regions, mapped into the holder for the load; reads land in them directly."""

    def __init__(self, allocations: list[Allocation]) -> None:
        self._maps: list[mmap.mmap] = []
        try:
            for a in allocations:
                [fd] = a.fds
                self._maps.append(mmap.mmap(fd, a.size, mmap.MAP_SHARED,
                                            mmap.PROT_READ | mmap.PROT_WRITE))
        except BaseException:
            self.close()
            raise
        self._views = [memoryview(m) for m in self._maps]

    def write(self, region: int, offset: int, fd: int, file_offset: int, length: int) -> None:
        pread_into(fd, self._views[region][offset:offset + length], file_offset)

    def finish(self) -> None:
        return None

    def close(self) -> None:
        for v in getattr(self, "_views", []):
            v.release()
        for m in self._maps:
            m.close()
        self._maps.clear()


@dataclass
class _Lane:
    """One worker thread's pinned buffers, their events and its stream (cuda)."""

    stream: Any
    buffers: list[int]
    events: list[Any]
    turn: int = 0


class CudaSink:
    """CUDA VMM regions, mapped into a VA range of the holder's for the load.

    The holder serves without a CUDA context (it only creates and exports allocations),
    but copies need one: the device's primary context is retained for the load and
    released right after, so an idle holder costs no context memory on the GPU.
    """

    def __init__(self, backend: Any, allocations: list[Allocation], piece: int = PIECE,
                 driver: Any = None) -> None:
        from agent.holder.backends.cuda import check

        if driver is None:
            from cuda.bindings import driver
        cu = driver

        self._cu, self._check = cu, check
        self._piece = piece
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self._local = threading.local()
        self._bases: list[tuple[int, int, list[int]]] = []  # (base, size, chunk sizes)
        self._dev = check(cu.cuDeviceGet(backend.ordinal), "cuDeviceGet")
        self._ctx = check(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        try:
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            acc = cu.CUmemAccessDesc()
            acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            acc.location.id = backend.ordinal
            acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            for a in allocations:
                base = int(check(cu.cuMemAddressReserve(a.size, backend.align, 0, 0),
                                 "cuMemAddressReserve"))
                self._bases.append((base, a.size, []))
                at = 0
                for h, length in zip(a.handle, a.chunks, strict=True):
                    check(cu.cuMemMap(base + at, length, 0, h, 0), "cuMemMap")
                    self._bases[-1][2].append(length)
                    at += length
                check(cu.cuMemSetAccess(base, a.size, [acc], 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise

    def _lane(self) -> _Lane:
        lane = getattr(self._local, "lane", None)
        if lane is not None:
            return lane
        cu, check = self._cu, self._check
        check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                       "cuStreamCreate")
        lane = _Lane(stream=stream, buffers=[], events=[])
        with self._lock:
            self._lanes.append(lane)
        for _ in range(2):
            lane.buffers.append(int(check(cu.cuMemHostAlloc(self._piece, 0), "cuMemHostAlloc")))
            lane.events.append(check(cu.cuEventCreate(
                int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate"))
        self._local.lane = lane
        return lane

    def write(self, region: int, offset: int, fd: int, file_offset: int, length: int) -> None:
        import ctypes

        cu, check = self._cu, self._check
        lane = self._lane()
        base = self._bases[region][0]
        done = 0
        while done < length:
            n = min(self._piece, length - done)
            b = lane.turn
            lane.turn ^= 1
            # Double buffering: this buffer's last copy must be done before it is refilled,
            # while the other buffer's copy may still run.
            check(cu.cuEventSynchronize(lane.events[b]), "cuEventSynchronize")
            view = memoryview((ctypes.c_char * n).from_address(lane.buffers[b])).cast("B")
            pread_into(fd, view, file_offset + done)
            check(cu.cuMemcpyHtoDAsync(base + offset + done, lane.buffers[b], n, lane.stream),
                  "cuMemcpyHtoDAsync")
            check(cu.cuEventRecord(lane.events[b], lane.stream), "cuEventRecord")
            done += n

    def finish(self) -> None:
        cu, check = self._cu, self._check
        check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        for lane in self._lanes:
            check(cu.cuStreamSynchronize(lane.stream), "cuStreamSynchronize")

    def close(self) -> None:
        cu = self._cu
        errors = []

        def attempt(result: Any, what: str) -> None:
            try:
                self._check(result, what)
            except BackendError as e:
                errors.append(str(e))

        attempt(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        for lane in self._lanes:
            attempt(cu.cuStreamSynchronize(lane.stream), "cuStreamSynchronize")
            for buf in lane.buffers:
                attempt(cu.cuMemFreeHost(buf), "cuMemFreeHost")
            for ev in lane.events:
                attempt(cu.cuEventDestroy(ev), "cuEventDestroy")
            attempt(cu.cuStreamDestroy(lane.stream), "cuStreamDestroy")
        self._lanes.clear()
        for base, size, chunks in self._bases:
            at = 0
            for length in chunks:
                attempt(cu.cuMemUnmap(base + at, length), "cuMemUnmap")
                at += length
            attempt(cu.cuMemAddressFree(base, size), "cuMemAddressFree")
        self._bases.clear()
        if self._ctx is not None:
            attempt(cu.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
            self._ctx = None
        if errors:
            raise BackendError("after the refill: " + "; ".join(errors))


def make_sink(backend: Backend, allocations: list[Allocation]) -> Sink:
    if backend.name == "cpu":
        return CpuSink(allocations)
    if backend.name == "cuda":
        return CudaSink(backend, allocations)
    raise BackendError(f"the {backend.name} backend cannot be refilled")


class Throttle:
    """Caps the bytes a second all threads read together (`--refill-rate`), so a refill at
    boot leaves a shared disk to others; None: as fast as the storage allows."""

    def __init__(self, rate: float | None, cancelled: threading.Event) -> None:
        self.rate = rate
        self._cancelled = cancelled
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._taken = 0

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            self._taken += n
            due = self._t0 + self._taken / self.rate
        while (wait := due - time.monotonic()) > 0:
            if self._cancelled.wait(min(wait, 0.1)):
                return


@dataclass(eq=False)
class RefillJob:
    """One load of a plan's regions, on a thread; `done` is called when it ends either way.

    Example::

        job = RefillJob(plan, allocations, make_sink(backend, allocations), on_done=wake)
        job.start()        # ... on_done() from the job's thread
        job.join(); job.error or job.seconds
    """

    plan: RefillPlan
    allocations: list[Allocation]
    sink: Sink
    on_done: Callable[[], None]
    threads: int = DEFAULT_THREADS
    rate: float | None = None
    piece: int = PIECE
    waiters: list[Any] = field(default_factory=list)
    error: RefillFailure | None = None
    fault: GpuFaultError | None = None
    seconds: float = 0.0
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def digest(self) -> str:
        return self.plan.digest

    @property
    def bytes(self) -> int:
        return self.plan.bytes

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="refill", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Stop between pieces and wait for the thread; what was loaded is never committed."""
        self._cancelled.set()
        self.join()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self._load()
        except RefillFailure as e:
            self.error = e
        except GpuFaultError as e:
            self.fault = e
            self.error = RefillFailure(ErrorCode.REFILL_FAILED, str(e))
        except BackendError as e:
            self.error = RefillFailure(ErrorCode.REFILL_FAILED, str(e))
        except OSError as e:
            self.error = RefillFailure(ErrorCode.REFILL_FAILED, f"{e.filename or 'read'}: "
                                       f"{e.strerror}")
        except Exception as e:  # noqa: BLE001 - the loop must hear of any end, and say why
            log.exception("refill of %s failed", self.digest)
            self.error = RefillFailure(ErrorCode.REFILL_FAILED, f"{type(e).__name__}: {e}")
        finally:
            self.seconds = time.monotonic() - t0
            with contextlib.suppress(BackendError):
                self.sink.close()
            self.on_done()

    def _load(self) -> None:
        model = Path(self.plan.model)
        keys = {f.name: f.key for f in self.plan.files}
        fds: dict[str, int] = {}
        try:
            for r in self.plan.regions:
                if r.file not in fds:
                    fds[r.file] = os.open(model / r.file, os.O_RDONLY | os.O_CLOEXEC)
                    self._same(r.file, fds[r.file], keys[r.file])
            pieces = [(i, r, off, min(self.piece, r.size - off))
                      for i, r in enumerate(self.plan.regions)
                      for off in range(0, r.size, self.piece)]
            throttle = Throttle(self.rate, self._cancelled)

            def one(job: tuple[int, PlanRegion, int, int]) -> None:
                i, r, off, n = job
                if self._cancelled.is_set():
                    raise RefillFailure(ErrorCode.REFILL_FAILED, "cancelled")
                throttle.take(n)
                if self._cancelled.is_set():
                    raise RefillFailure(ErrorCode.REFILL_FAILED, "cancelled")
                self.sink.write(i, off, fds[r.file], r.offset + off, n)

            with ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="refill") as pool:
                futures = [pool.submit(one, j) for j in pieces]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    self._cancelled.set()
                    raise
            self.sink.finish()
            # A file rewritten while it was read gave bytes of neither version.
            for name, fd in fds.items():
                self._same(name, fd, keys[name])
        finally:
            for fd in fds.values():
                os.close(fd)

    def _same(self, name: str, fd: int, key: list[int]) -> None:
        now = stat_key(os.fstat(fd))
        if now != key:
            raise RefillFailure(ErrorCode.DRIFT, f"{Path(self.plan.model) / name} changed since "
                                "the refill plan was made (its size, times or inode differ)")
