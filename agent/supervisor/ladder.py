"""The recovery ladder: start paths tried fastest first, each falling to the next."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from agent.recovery import Cause, Fall
from agent.refusal import Refusal
from agent.supervisor.canary import CanaryRecord
from agent.supervisor.engine import EngineProcess
from agent.supervisor.status import Fallthrough

# What one rung's `prepare` found and its `start` uses: the snapshot chosen, or nothing.
log = logging.getLogger("pitstop.supervisor")

T = TypeVar("T")


class StopRequested(Exception):  # noqa: N818 - a signal, not a failure
    """A stop came while a rung was tried: the walk ends there, its engine stopped."""


@dataclass
class Attempt:
    """One walk of the ladder: why it started, and the stage timings a path records."""

    cause: Cause
    stages: dict[str, float] = field(default_factory=dict)
    # The GPU fault this walk works around ("" for none): see agent/supervisor/gpu.py.
    gpu_fault: str = ""
    # The rungs passed over so far, and why (what `pitstop status` shows of a recovery).
    fallthroughs: list[Fallthrough] = field(default_factory=list)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.monotonic() - t0

    def fall(self, path: str, kind: Fall, refusal: Refusal) -> None:
        """Pass over rung `path` for `refusal`: logged (a rung that cannot apply, as when
        there is no snapshot yet, is routine; one that broke is not) and kept."""
        fall = Fallthrough(path, kind, refusal)
        level = logging.INFO if kind is Fall.SKIPPED else logging.WARNING
        log.log(level, "ladder: %s (%s)", fall, refusal.code)
        self.fallthroughs.append(fall)


@dataclass(frozen=True)
class Prepared(Generic[T]):
    """What a rung's `prepare` found, handed to that rung's `start` (and nothing else does).

    Example::

        Prepared(rung="full", plan=manifest, canary=record, stages={"select": 0.4})
    """

    rung: str
    # The rung's own plan: the manifest to restore; None for a rung that needs none.
    plan: T
    # The answer this engine must give; None to use the agent's recorded one.
    canary: CanaryRecord | None = None
    # Stages timed during preparation (verifying a snapshot's files is part of a restore's
    # cost); added to the attempt only when this rung is started.
    stages: dict[str, float] = field(default_factory=dict)


class StartPath(Protocol[T]):
    """One rung: hybrid restore, refill, full restore, warm start, cold start, or vLLM's own.

    `prepare` decides, off the event loop, whether the rung can be tried now and what it
    would start from; it keeps nothing for `start`, which gets what `prepare` returned.

    Example::

        ready = await path.prepare(attempt)          # Refusal when it cannot be tried now
        if not isinstance(ready, Refusal):
            engine = await path.start(attempt, ready)  # raises StartPathError to fall through
    """

    name: str
    # Whether its engine uses memory that outlived the failed one (held weights): such a
    # rung is never tried after a GPU fault (agent/supervisor/gpu.py `ruled_out`).
    reuses_held_memory: bool

    async def prepare(self, attempt: Attempt) -> Prepared[T] | Refusal:
        """What this rung would start from, or why it cannot be tried now; blocking work
        (hashing a snapshot, asking the holder) runs in a worker thread."""
        ...

    async def start(self, attempt: Attempt, prepared: Prepared[T]) -> EngineProcess:
        """Bring up an engine from `prepared`; raise StartPathError when it cannot."""
        ...

    def start_limit_s(self, prepared: Prepared[T]) -> float:
        """The longest `start` from `prepared` may take before it is stuck (the wait for
        health after it is not part of it)."""
        ...

    async def after_verified(self, engine: EngineProcess, prepared: Prepared[T]) -> None:
        """Work once the engine is verified (a restore path may re-attach memory here)."""
        ...

    async def failed(self, prepared: Prepared[T], reason: str) -> None:
        """The engine started from `prepared` failed verification (quarantine the snapshot,
        in a worker thread: that renames, fsyncs and may delete images of many GB)."""
        ...


class Beside(Protocol):
    """A rung that needs nothing of a dead engine's tree (the standby: namespaces of its own,
    room on the GPU beside the dead engine): the supervisor tries it while that tree is
    still being torn down, where every other rung waits for the tree to be gone.

    Example::

        if beside.serves_beside_dead():   # asked once the engine is seen dead
            ...                           # kill the tree, walk the ladder, reap it behind
    """

    name: str

    def serves_beside_dead(self) -> bool:
        """Whether it is armed and could serve before the dead tree is gone."""
        ...


class Puller(Protocol):
    """Takes a snapshot from the fleet's store before a walk finds none (agent/supervisor/
    remote.py): blocking work in a thread, for at most `limit_s`."""

    @property
    def limit_s(self) -> float: ...

    async def before_walk(self, attempt: Attempt) -> None: ...
