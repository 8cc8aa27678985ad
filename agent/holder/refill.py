"""The holder's refill: load a model's weights from its files into uncommitted regions.

The server makes the sink (cuda: it starts making the CUDA context and the pinned buffers
on a thread at once, so that overlaps the regions' creation), creates the regions
(uncommitted, so no tenant can attach them), runs a `RefillJob` on a thread of its own,
and commits every region at once on its loop when the job ends well. Reads run on several
threads at once; each piece goes straight into the region (cpu: the memfd mapped here) or
through pinned host buffers and asynchronous host-to-device copies on a stream per thread,
so the next reads overlap the copies (cuda).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from agent.holder.backends import Allocation, Backend, BackendError, GpuFaultError
from agent.holder.protocol import ErrorCode
from agent.holder.weightplan import PlanRegion, RefillPlan
from agent.weights import stat_key

log = logging.getLogger("pitstop.holder.refill")

PAGE = mmap.PAGESIZE


class Host(StrEnum):
    """Where a piece waits in host memory for its copy to the GPU (cuda)."""

    # cuMemHostAlloc'ed buffers: the driver's own pinned memory.
    PINNED = "pinned"
    # cuMemHostAlloc(CU_MEMHOSTALLOC_WRITECOMBINED): the CPU only writes these buffers and
    # the GPU only reads them, so writes need not go through (and evict) the CPU caches.
    WRITE_COMBINED = "wc"
    # Anonymous memory in 2 MiB pages (MADV_HUGEPAGE), pinned with cuMemHostRegister: the
    # kernel's copies into it miss the TLB once every 2 MiB instead of every 4 KiB.
    HUGE_PAGES = "huge"
    # No buffers: the files are mapped here and each piece's page-cache pages registered
    # (cuMemHostRegister, read-only) and copied from where they are; the CPU copies nothing.
    DIRECT = "direct"


@dataclass(frozen=True)
class Tuning:
    """How a refill reads and copies; `DEFAULT_TUNING` is what the holder uses.

    Example::

        Tuning(threads=16, piece=64 << 20, buffers=3, host=Host.HUGE_PAGES)
        replace(DEFAULT_TUNING, threads=4)     # `pitstop holder --refill-threads 4`
    """

    # Reads in flight: page cache and NVMe both want several to reach their rate. From
    # the page cache each read is a kernel memcpy, so a thread moves what one core copies.
    threads: int
    # Bytes of one read, and on cuda of one host-to-device copy and one host buffer.
    piece: int = 16 << 20
    # Host buffers per thread (cuda; registrations in flight when direct): a thread reads
    # into one while the copies of the others run; threads x buffers x piece bytes pinned.
    buffers: int = 2
    host: Host = Host.PINNED

    def __post_init__(self) -> None:
        if self.threads < 1 or self.piece < 1 or self.buffers < 1:
            raise ValueError(f"{self}: threads, piece and buffers must be positive")
        if self.piece % PAGE:
            raise ValueError(f"{self}: a piece is a whole number of {PAGE}-byte pages")


# The one place the refill's defaults live; bench/refill_bench.py sweeps every knob on a
# GPU in one run. One thread a core, up to 16: the reads from the page cache are copies.
DEFAULT_TUNING = Tuning(threads=min(16, os.cpu_count() or 1), piece=16 << 20, buffers=2,
                        host=Host.PINNED)
# cuda.h's CU_MEMHOSTALLOC_WRITECOMBINED, for bindings that do not name it.
WRITECOMBINED = 0x04


class RefillFailure(Exception):
    """A refill that cannot complete; `code` is what the waiting clients are told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Sink(Protocol):
    """Where a refill's bytes go: regions of one backend, written from worker threads."""

    timings: dict[str, float]

    def open(self, allocations: list[Allocation]) -> None:
        """Make `allocations` writable here; on the job's thread, before the first write."""
        ...

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

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self.timings: dict[str, float] = {}

    def open(self, allocations: list[Allocation]) -> None:
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
        for v in self._views:
            v.release()
        self._views = []
        for m in self._maps:
            m.close()
        self._maps.clear()


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
                stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                               "cuStreamCreate")
                lane = _Lane(stream=stream)
                self._lanes.append(lane)
                for _ in range(self._tuning.buffers):
                    if self._tuning.host is not Host.DIRECT:
                        buf = self._buffer(lane)
                        lane.address.append(buf)
                        lane.views.append(memoryview(
                            (ctypes.c_char * self._tuning.piece).from_address(buf)).cast("B"))
                    lane.registered.append(None)
                    lane.events.append(check(cu.cuEventCreate(
                        int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate"))
                self._free.append(lane)
            self.timings["pinned_s"] = time.monotonic() - t1
        except BaseException as e:  # noqa: BLE001 - handed to the job's thread by open()
            self._prep_error = e

    def _buffer(self, lane: _Lane) -> int:
        """One host buffer of a piece for `lane`, pinned as the tuning says; its address."""
        cu, check, n = self._cu, self._check, self._tuning.piece
        if self._tuning.host is Host.HUGE_PAGES:
            # Over-allocated by a huge page so the buffer can start on one.
            length = n + HUGE
            base = _libc_mmap(length, -1, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            lane.anonymous.append((base, length))
            buf = -(-base // HUGE) * HUGE
            _libc.madvise(buf, n, MADV_HUGEPAGE)  # advice only: 4 KiB pages still work
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
                addr = _libc_mmap(length, fd)
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
        cu = self._cu
        self._prep.join()
        errors = []

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
                _libc_munmap(base, length)
            for ev in lane.events:
                attempt(cu.cuEventDestroy(ev), "cuEventDestroy")
            attempt(cu.cuStreamDestroy(lane.stream), "cuStreamDestroy")
        self._lanes.clear()
        self._free.clear()
        for addr, length in self._files.values():
            _libc_munmap(addr, length)
        self._files.clear()
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
            attempt(cu.cuCtxSetCurrent(previous), "cuCtxSetCurrent")
        if errors:
            raise BackendError("after the refill: " + "; ".join(errors))


# cuda.h's CU_MEMHOSTREGISTER_READ_ONLY: the pages are a read-only mapping of the file.
REGISTER_READ_ONLY = 0x08
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20
MADV_HUGEPAGE = 14


def _libc_mmap(length: int, fd: int, prot: int = mmap.PROT_READ,
               flags: int = mmap.MAP_SHARED) -> int:
    """mmap(2), by default of a whole file, read-only and shared: the page cache's own
    pages (Python's mmap gives no address for a read-only map)."""
    addr = _libc.mmap(None, length, prot, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    return int(addr)


def _libc_munmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


def make_sink(backend: Backend, tuning: Tuning = DEFAULT_TUNING) -> Sink:
    """The sink for `backend`'s regions; made before they are created (see CudaSink)."""
    if backend.name == "cpu":
        return CpuSink()
    if backend.name == "cuda":
        return CudaSink(backend, tuning)
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

        sink = make_sink(backend, tuning)       # cuda: the context is being made
        allocations = [backend.allocate(r.name, r.size) for r in plan.regions]
        job = RefillJob(plan, allocations, sink, on_done=wake, tuning=tuning)
        job.start()        # ... on_done() from the job's thread
        job.join(); job.error or job.seconds, job.timings
    """

    plan: RefillPlan
    allocations: list[Allocation]
    sink: Sink
    on_done: Callable[[], None]
    tuning: Tuning = DEFAULT_TUNING
    rate: float | None = None
    waiters: list[Any] = field(default_factory=list)
    error: RefillFailure | None = None
    fault: GpuFaultError | None = None
    seconds: float = 0.0
    # Where the seconds went: the sink's (context_s, pinned_s, waited_s, map_s) and the
    # job's own (open_s, read_s, finish_s); for the log and bench/refill_bench.py.
    timings: dict[str, float] = field(default_factory=dict)
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
            self.timings = {**self.sink.timings, **self.timings}
            self.on_done()

    def _load(self) -> None:
        model = Path(self.plan.model)
        keys = {f.name: f.key for f in self.plan.files}
        fds: dict[str, int] = {}
        piece = self.tuning.piece
        pieces: list[tuple[int, PlanRegion, int, int]] = []
        try:
            for r in self.plan.regions:
                if r.file not in fds:
                    fds[r.file] = os.open(model / r.file, os.O_RDONLY | os.O_CLOEXEC)
                    self._same(r.file, fds[r.file], keys[r.file])
            t0 = time.monotonic()
            self.sink.open(self.allocations)
            self.timings["open_s"] = time.monotonic() - t0
            # Cut where the file offset is a multiple of the piece: every piece but a
            # region's first starts on a page (the kernel's copies are aligned), and in
            # direct mode no two pieces share a page to register.
            pieces = []
            for i, r in enumerate(self.plan.regions):
                at, end = r.offset, r.offset + r.size
                while at < end:
                    cut = min(end, (at // piece + 1) * piece)
                    pieces.append((i, r, at - r.offset, cut - at))
                    at = cut
            throttle = Throttle(self.rate, self._cancelled)
            # Each worker takes the next piece itself (next() of a count is atomic): no
            # future or queue per piece, so small pieces cost little Python.
            order = itertools.count()
            errors: list[BaseException] = []
            write = self.sink.write

            def worker() -> None:
                try:
                    while not self._cancelled.is_set():
                        k = next(order)
                        if k >= len(pieces):
                            return
                        i, r, off, n = pieces[k]
                        throttle.take(n)
                        if self._cancelled.is_set():
                            break
                        write(i, off, fds[r.file], r.offset + off, n)
                except BaseException as e:  # noqa: BLE001 - raised on the job's thread below
                    errors.append(e)
                    self._cancelled.set()

            t1 = time.monotonic()
            workers = [threading.Thread(target=worker, name=f"refill-{n}", daemon=True)
                       for n in range(min(self.tuning.threads, len(pieces)))]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if errors:
                raise errors[0]  # the first: the others may only have seen it cancel them
            if self._cancelled.is_set():
                raise RefillFailure(ErrorCode.REFILL_FAILED, "cancelled")
            t2 = time.monotonic()
            self.sink.finish()
            self.timings["read_s"], self.timings["finish_s"] = t2 - t1, time.monotonic() - t2
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
