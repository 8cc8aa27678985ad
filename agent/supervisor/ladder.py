"""The recovery ladder: start paths tried fastest first, each falling to the next."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from agent.supervisor.canary import CanaryRecord
from agent.supervisor.engine import EngineProcess


@dataclass
class Attempt:
    """One walk of the ladder: why it started, and the stage timings a path records."""

    cause: str
    stages: dict[str, float] = field(default_factory=dict)
    # The GPU fault this walk works around ("" for none): see agent/supervisor/gpu.py.
    gpu_fault: str = ""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.monotonic() - t0


class StartPath(Protocol):
    """One rung: hybrid restore, full restore, warm start or cold start.

    Example::

        reason = path.skip_reason()        # None when the path can be tried now
        engine = await path.start(attempt)  # raises StartPathError to fall through
    """

    name: str
    # Whether its engine uses memory that outlived the failed one (held weights): such a
    # rung is never tried after a GPU fault (agent/supervisor/gpu.py `ruled_out`).
    reuses_held_memory: bool

    def skip_reason(self) -> str | None:
        """Why this path cannot be tried now (no snapshot, holder gone, ...); None if it can."""
        ...

    async def start(self, attempt: Attempt) -> EngineProcess:
        """Bring up an engine; raise StartPathError with the reason when it cannot."""
        ...

    def expected_canary(self) -> CanaryRecord | None:
        """The answer this path's engine must give; None to use the agent's recorded one."""
        ...

    async def after_verified(self, engine: EngineProcess) -> None:
        """Work once the engine is verified (a restore path may re-attach memory here)."""
        ...

    def failed(self, reason: str) -> None:
        """The engine this path produced failed verification (quarantine what caused it)."""
        ...
