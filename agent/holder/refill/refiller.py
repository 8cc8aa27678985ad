"""The holder's one refill at a time: the sink made ahead, the running job, its commit."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import ModelError
from agent.holder import protocol as p
from agent.holder.backends import Backend, BackendError, GpuFaultError
from agent.holder.refill import DEFAULT_TUNING, RefillFailure, Sink, Tuning
from agent.holder.refill.job import RefillJob, make_sink
from agent.holder.regions import RegionTable, RequestRefused
from agent.holder.weightplan import RefillPlan, load_plan

log = logging.getLogger("pitstop.holder")


@dataclass(eq=False)
class RefillWriter:
    """The writer of a refill's regions: the holder itself, until the job commits them."""

    pid: int


class Refiller:
    """Loads the weights the refill plan in the holder's directory names, one load at a
    time, into regions no tenant sees until all of them are committed.

    The job reads on threads of its own; it says it ended through `wakeup` (a socket the
    server's selector watches), and `ended` commits or frees its regions on the server's
    loop, which owns the region table, then answers every session that asked.

    Example::

        refiller = Refiller(backend, table, directory, answer=reply_to_waiters)
        selector.register(refiller.wakeup, EVENT_READ, lambda s: refiller.ended(s))
        refiller.request(digest, session)   # None: the answer comes when the load ends
    """

    def __init__(self, backend: Backend, table: RegionTable, directory: Path, *,
                 answer: Callable[[list[Any], p.Reply], None],
                 tuning: Tuning = DEFAULT_TUNING, rate: float | None = None) -> None:
        self._backend = backend
        self._table = table
        self._directory = directory
        self._answer = answer
        self._tuning = tuning
        self._rate = rate
        # The one refill that may run, its writer, and how its thread says it ended.
        self._job: RefillJob | None = None
        self.writer: RefillWriter | None = None
        self.wakeup, self._wake_w = socket.socketpair()
        self.wakeup.setblocking(False)
        # A sink made ahead of the refill it will serve (`prepare`): its context, streams
        # and pinned buffers are ready when the request comes.
        self._ready_sink: Sink | None = None
        self._ready_digest = ""

    def request(self, digest: str, waiter: Any = None) -> p.Reply | None:
        """Start loading `digest` from the plan in the holder's directory; None when the
        answer comes at the end of the load (to `waiter`), else the answer now."""
        job = self._job
        if job is not None:
            if job.digest != digest:
                return p.error_reply(p.ErrorCode.BUSY, f"a refill of {job.digest} is running; "
                                     "ask again when it ended")
            if waiter is not None:
                job.waiters.append(waiter)
            return None
        plan = self._plan_of(digest)
        if isinstance(plan, p.Reply):
            return plan
        if self._complete(digest):
            return p.Reply(ok=True, refilled=p.Refilled(digest=digest, regions=len(plan.regions),
                                                        bytes=0, seconds=0.0))
        drift = plan.drift()
        if drift is not None:
            return self._unplanned(p.ErrorCode.DRIFT, f"refill of {digest} refused: {drift}")
        return self._start(plan, waiter)

    def _plan_of(self, digest: str) -> RefillPlan | p.Reply:
        """The plan in the directory when it is for `digest`; else the refusal."""
        try:
            plan = load_plan(self._directory)
        except ModelError as e:
            return self._unplanned(p.ErrorCode.NO_PLAN, str(e))
        if plan is None:
            return self._unplanned(p.ErrorCode.NO_PLAN, f"no refill plan in {self._directory}: "
                                   "the agent writes one once an engine has committed weights "
                                   "to this holder")
        if plan.digest != digest:
            return self._unplanned(p.ErrorCode.NO_PLAN, f"the refill plan in {self._directory} "
                                   f"is for weights {plan.digest}, not {digest}")
        return plan

    def _start(self, plan: RefillPlan, waiter: Any) -> p.Reply | None:
        digest = plan.digest
        writer = RefillWriter(pid=os.getpid())
        t0 = time.monotonic()
        sink, self._ready_sink = self._ready_sink, None
        ready = sink is not None
        if sink is None:
            try:
                # First: the cuda sink makes its context and pinned buffers meanwhile.
                sink = make_sink(self._backend, self._tuning)
            except BackendError as e:
                return p.error_reply(p.ErrorCode.REFILL_FAILED, f"refill of {digest}: {e}")
        try:
            allocations = [self._table.create(writer, r.name, r.size, digest,
                                              len(plan.regions)).allocation
                           for r in plan.regions]
        except BaseException as e:
            self._table.session_closed(writer)
            with contextlib.suppress(BackendError):
                sink.close()
            if isinstance(e, GpuFaultError):
                raise  # serve() stops: the GPU's memory is not to be trusted
            if isinstance(e, RequestRefused):
                return p.error_reply(e.code, f"refill of {digest}: {e}")
            if isinstance(e, BackendError):
                return p.error_reply(p.ErrorCode.REFILL_FAILED, f"refill of {digest}: {e}")
            raise
        self.writer = writer
        self._job = RefillJob(plan, allocations, sink, on_done=self._wake,
                              tuning=self._tuning, rate=self._rate)
        self._job.timings["create_s"] = time.monotonic() - t0
        if waiter is not None:
            self._job.waiters.append(waiter)
        log.info("refill of %s started: %d regions, %d bytes from %s%s", digest,
                 len(plan.regions), plan.bytes, plan.model,
                 " (its sink made ahead)" if ready else "")
        self._job.start()
        return None

    def prepare(self) -> None:
        """At start-up without a refill of its own: when the directory has a plan, make the
        sink now, so that a refill the agent asks for later is reading and copying only.

        On cuda that is the device's primary context (some hundred MB of GPU memory), a
        stream and `buffers` pinned pieces per thread (512 MiB by default) — about half a
        second to make, a third of a 32 GiB refill. They go with the first refill."""
        try:
            plan = load_plan(self._directory)
        except ModelError as e:
            log.warning("no refill prepared: %s", e)
            return
        if plan is None or self._ready_sink is not None or self._complete(plan.digest):
            return
        try:
            self._ready_sink = make_sink(self._backend, self._tuning)
        except BackendError as e:
            log.warning("no refill prepared: %s", e)
            return
        self._ready_digest = plan.digest
        log.info("ready to refill %s: context, streams and buffers made ahead", plan.digest)

    def from_plan(self) -> None:
        """At start-up: load the weights the plan in the directory names, if there is one."""
        try:
            plan = load_plan(self._directory)
        except ModelError as e:
            log.warning("no refill at start-up: %s", e)
            return
        if plan is None:
            return
        reply = self.request(plan.digest)
        if reply is not None and reply.error is not None:
            log.warning("no refill at start-up: %s", reply.error.message)

    def committed(self, digest: str) -> None:
        """An engine committed a whole set of weights itself, the plan's or others (it
        started on another model): no refill is coming for the sink made ahead."""
        if self._ready_sink is None or not self._complete(digest):
            return
        ready = self._ready_digest
        self._discard_ready_sink()
        log.info("no longer ready to refill %s: an engine committed %s", ready,
                 "the weights" if digest == ready else f"other weights ({digest})")

    def drop(self, reason: str) -> None:
        """Everything held is being dropped: a load under way ends, committing nothing."""
        if self._job is not None:
            self._job.cancel()
            self.ended(None, dropped=reason)

    def close(self) -> None:
        if self._job is not None:
            # Stopped mid-load: the job ends between pieces and its regions go uncommitted.
            self._job.cancel()
            self._job = None
        self._discard_ready_sink()
        self.wakeup.close()
        self._wake_w.close()

    def _unplanned(self, code: p.ErrorCode, message: str) -> p.Reply:
        """A refill refused for its plan (none, another digest's, drifted): the sink made
        ahead for that plan is not kept for one that cannot come."""
        if self._ready_sink is not None:
            ready = self._ready_digest
            self._discard_ready_sink()
            log.info("no longer ready to refill %s: %s", ready, message)
        return p.error_reply(code, message)

    def _discard_ready_sink(self) -> None:
        if self._ready_sink is not None:
            with contextlib.suppress(BackendError):
                self._ready_sink.close()
            self._ready_sink = None

    def _complete(self, digest: str) -> bool:
        return p.whole_set([r for r in self._table.committed.values() if r.digest == digest])

    def _wake(self) -> None:
        # From the job's thread: the table is the loop's, so the loop finishes the job.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def ended(self, sock: socket.socket | None, dropped: str = "") -> None:
        """On the server's loop, once the job said it ended (or was cancelled): commit all
        its regions or none, and answer every session waiting for it."""
        if sock is not None:
            with contextlib.suppress(BlockingIOError):
                sock.recv(64)
        job, writer = self._job, self.writer
        if job is None or writer is None:
            return
        job.join()
        self._job, self.writer = None, None
        if job.fault is not None:
            raise job.fault  # serve() stops: the GPU's memory is not to be trusted
        mine = [r for r in self._table.pending.values() if r.writer is writer]
        error = job.error
        if error is None and dropped:
            error = RefillFailure(p.ErrorCode.REFILL_FAILED, f"dropped ({dropped}) mid-load")
        if error is None and len(mine) != len(job.plan.regions):
            error = RefillFailure(p.ErrorCode.REFILL_FAILED, "its regions were dropped mid-load")
        if error is not None:
            self._table.session_closed(writer)  # uncommitted: freed, never shown
            reply = p.error_reply(error.code, f"refill of {job.digest} failed: {error}; "
                                  "nothing was committed")
            log.error("%s", reply.error.message if reply.error else error)
        else:
            # All on this thread, between two requests: a reader sees none or all of them.
            for r in mine:
                self._table.commit(writer, r.name)
            # From the request to here: creating the regions, then the job's load.
            done = p.Refilled(digest=job.digest, regions=len(mine), bytes=job.bytes,
                              seconds=job.timings.get("create_s", 0.0) + job.seconds)
            reply = p.Reply(ok=True, refilled=done)
            log.info("refill of %s committed: %d bytes in %.2fs (%.2f GB/s); %s", job.digest,
                     done.bytes, done.seconds, done.gbps,
                     ", ".join(f"{k} {v:.3f}" for k, v in sorted(job.timings.items())))
        self._answer(job.waiters, reply)
