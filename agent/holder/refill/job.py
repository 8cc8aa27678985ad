"""One refill: a plan's files read on several threads into uncommitted regions, by a sink."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.holder.backends import Allocation, Backend, BackendError, GpuFaultError
from agent.holder.casts import Cast
from agent.holder.protocol import ErrorCode
from agent.holder.refill import DEFAULT_TUNING, RefillFailure, Sink, Tuning, pread_into
from agent.holder.refill.cpu import CpuSink
from agent.holder.refill.cuda import CudaSink
from agent.holder.refill.throttle import Throttle
from agent.holder.weightplan import PlanRegion, RefillPlan
from agent.weights import stat_key

log = logging.getLogger("pitstop.holder.refill")

# One piece of a load: (region index, file name, offset in the file, offset in the region,
# length in the region, cast); a file name of None is zeros (a recipe's span that no part of
# a file fills); a cast piece reads `cast.ratio` times its length from the file.
Piece = tuple[int, str | None, int, int, int, Cast | None]


def make_sink(backend: Backend, tuning: Tuning = DEFAULT_TUNING) -> Sink:
    """The sink for `backend`'s regions; made before they are created (see CudaSink)."""
    if backend.name == "cpu":
        return CpuSink()
    if backend.name == "cuda":
        return CudaSink(backend, tuning)
    raise BackendError(f"the {backend.name} backend cannot be refilled")


def cut(regions: list[PlanRegion], piece: int) -> list[Piece]:
    """The pieces of `regions`, cut where the file offset is a multiple of `piece`: every
    piece but a part's first starts on a page (the kernel's copies are aligned), and in
    direct mode no two pieces share a page to register. Then the zero spans, whole."""
    pieces: list[Piece] = []
    for i, r in enumerate(regions):
        for c in r.copies():
            if c.cast is not None:
                step = piece // c.cast.ratio
                pieces += [(i, c.file, c.at + k * c.cast.ratio, c.offset + k,
                            min(step, c.size - k), c.cast) for k in range(0, c.size, step)]
                continue
            at, end = c.at, c.at + c.size
            while at < end:
                step = min(end, (at // piece + 1) * piece)
                pieces.append((i, c.file, at, c.offset + at - c.at, step - at, None))
                at = step
    for i, r in enumerate(regions):
        pieces += [(i, None, 0, offset, n, None) for offset, n in r.zeros()]
    return pieces


@dataclass(eq=False)
class RefillJob:
    """One load of a plan's regions, on a thread; `done` is called when it ends either way.

    The server makes the sink (cuda: it starts making the CUDA context and the pinned
    buffers on a thread at once, so that overlaps the regions' creation), creates the
    regions (uncommitted, so no tenant can attach them), runs the job on a thread of its
    own, and commits every region at once on its loop when the job ends well. Reads run
    on several threads at once; each piece goes straight into the region (cpu: the memfd
    mapped here) or through pinned host buffers and asynchronous host-to-device copies on
    a stream per thread, so the next reads overlap the copies (cuda).

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
        keys = {f.name: f.key for f in self.plan.files}
        fds: dict[str, int] = {}
        try:
            for name in sorted({f for r in self.plan.regions for f in r.files()}):
                fds[name] = os.open(Path(self.plan.model) / name, os.O_RDONLY | os.O_CLOEXEC)
                self._same(name, fds[name], keys[name])
            t0 = time.monotonic()
            self.sink.open(self.allocations)
            self.timings["open_s"] = time.monotonic() - t0
            t1 = time.monotonic()
            self._read(cut(self.plan.regions, self.tuning.piece), fds)
            t2 = time.monotonic()
            self.sink.finish()
            self.timings["read_s"], self.timings["finish_s"] = t2 - t1, time.monotonic() - t2
            # A file rewritten while it was read gave bytes of neither version.
            for name, fd in fds.items():
                self._same(name, fd, keys[name])
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read(self, pieces: list[Piece], fds: dict[str, int]) -> None:
        """Every piece written by the sink, on `tuning.threads` threads; the first error
        (or a cancel) raised here."""
        throttle = Throttle(self.rate, self._cancelled)
        # Each worker takes the next piece itself (next() of a count is atomic): no
        # future or queue per piece, so small pieces cost little Python.
        order = itertools.count()
        errors: list[BaseException] = []
        def worker() -> None:
            try:
                while not self._cancelled.is_set():
                    k = next(order)
                    if k >= len(pieces):
                        return
                    self._piece(pieces[k], fds, throttle)
            except BaseException as e:  # noqa: BLE001 - raised on the job's thread below
                errors.append(e)
                self._cancelled.set()

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

    def _piece(self, piece: Piece, fds: dict[str, int], throttle: Throttle) -> None:
        i, name, at, off, n, cast = piece
        if name is None:
            self.sink.zero(i, off, n)
            return
        throttle.take(n)
        if self._cancelled.is_set():
            return
        if cast is None:
            self.sink.write(i, off, fds[name], at, n)
            return
        raw = bytearray(n * cast.ratio)
        pread_into(fds[name], memoryview(raw), at)
        self.sink.put(i, off, cast.apply(bytes(raw)))

    def _same(self, name: str, fd: int, key: list[int]) -> None:
        now = stat_key(os.fstat(fd))
        if now != key:
            raise RefillFailure(ErrorCode.DRIFT, f"{Path(self.plan.model) / name} changed since "
                                "the refill plan was made (its size, times or inode differ)")
