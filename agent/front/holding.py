"""The bounded wait for a ready engine: hold requests across a restore, never hang them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from enum import StrEnum

from agent.config import QueueConfig
from agent.errors import FrontRejected
from agent.metrics import Metrics
from agent.supervisor.gate import EngineGate, Ready


class FrontFailure(StrEnum):
    """Why the front gave up on a request: `pitstop_front_failed_requests_total{reason}`."""

    # No engine became ready within front.queue.deadline_s.
    DEADLINE = "deadline"
    # front.queue.max_waiting requests already wait.
    QUEUE_FULL = "queue_full"
    # The front is shutting down.
    DRAINING = "draining"
    # The engine died under this request more than front.max_resumes times.
    RESUME_LIMIT = "resume_limit"
    # The engine died during the answer and the request cannot be continued.
    NOT_RESUMABLE = "not_resumable"
    # The engine died under the request, and no recovered engine came in time or the
    # answer already streamed could not be continued.
    ENGINE_LOST = "engine_lost"
    # The recovered engine refused the continuation.
    ENGINE_ERROR = "engine_error"
    # The client went away before its answer was complete.
    CLIENT_GONE = "client_gone"


class Holding:
    """Admits requests to the engine through the gate, holding them while it is down.

    New requests wait at most `deadline_s`, and at most `max_waiting` of them (resuming ones
    included) wait at once; past either bound, or once the front is stopping, they are
    rejected with `FrontRejected` (the front answers 503 + Retry-After). Requests whose
    answer was cut by a crash wait through `resume()`: they are already admitted, so the
    bound does not turn them away, but they count in the depth.

    Example::

        holding = Holding(gate, QueueConfig(max_waiting=8, deadline_s=5), metrics)
        ready = await holding.admit()   # Ready, or raises FrontRejected
    """

    def __init__(self, gate: EngineGate, config: QueueConfig, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # `clock` must be the gate's (time.monotonic): down_since is compared with it.
        self._gate = gate
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._stopping = asyncio.Event()
        self.depth = 0

    def reconfigure(self, config: QueueConfig) -> None:
        """A reloaded front.queue: requests held from now on use it."""
        self._config = config

    def stop(self) -> None:
        """Reject every waiting and future request: the front is shutting down."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def would_admit(self) -> bool:
        """Whether a new request would be served or held now (the /ready answer)."""
        if self.stopping:
            return False
        if self._gate.current is not None:
            return True
        if self.depth >= self._config.max_waiting:
            return False
        # Down for less than a deadline: a restore that holding hides. Longer: an outage
        # the load balancer should route around. (Paused for a snapshot: down_since None.)
        since = self._gate.down_since
        return since is None or self._clock() - since < self._config.deadline_s

    async def admit(self) -> Ready:
        """The ready engine for a new request; raises FrontRejected when it cannot wait."""
        if self.stopping:
            raise self._rejected(FrontFailure.DRAINING, "the front is shutting down")
        ready = self._gate.current
        if ready is not None:
            self._metrics.front_queue_wait.observe(0.0)
            return ready
        if self.depth >= self._config.max_waiting:
            raise self._rejected(
                FrontFailure.QUEUE_FULL, f"{self.depth} requests already wait for the engine "
                f"({self._gate.down_reason or 'down'}); front.queue.max_waiting is "
                f"{self._config.max_waiting}")
        start = self._clock()
        ready = await self._wait(self._config.deadline_s, after=0)
        self._metrics.front_queue_wait.observe(self._clock() - start)
        if ready is None:
            if self.stopping:
                raise self._rejected(FrontFailure.DRAINING, "the front is shutting down")
            raise self._rejected(
                FrontFailure.DEADLINE, f"no engine became ready within front.queue.deadline_s="
                f"{self._config.deadline_s:g} s ({self._gate.down_reason or 'down'})")
        return ready

    async def resume(self, lost: int, timeout: float) -> Ready | None:
        """An engine of a recovery after `lost` (the one that died under us), or None."""
        return await self._wait(timeout, after=lost)

    async def _wait(self, timeout: float, after: int) -> Ready | None:
        self.depth += 1
        try:
            waiter = asyncio.ensure_future(self._gate.wait_ready(timeout, after=after))
            stopper = asyncio.ensure_future(self._stopping.wait())
            try:
                await asyncio.wait((waiter, stopper), return_when=asyncio.FIRST_COMPLETED)
            finally:
                # A client that goes away cancels us here: leave no task behind.
                for t in (waiter, stopper):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
            return waiter.result() if waiter.done() and not waiter.cancelled() else None
        finally:
            self.depth -= 1

    def _rejected(self, reason: FrontFailure, message: str) -> FrontRejected:
        self._metrics.front_failed.labels(reason=reason).inc()
        return FrontRejected(reason, message, retry_after=self._config.retry_after_s)
