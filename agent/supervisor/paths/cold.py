"""Cold start: launch the engine from nothing. Always available; the ladder's last rung."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace

from agent.engines.base import EngineAdapter
from agent.supervisor.canary import CanaryRecord
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt


class ColdStart:
    """Start the engine the way it would start without Pitstop."""

    name = "cold"
    reuses_held_memory = False

    def __init__(self, adapter: EngineAdapter,
                 extra_args: Callable[[], list[str]] = lambda: []) -> None:
        self._adapter = adapter
        # Arguments decided at start time (the holder's socket when one answers).
        self._extra_args = extra_args

    def skip_reason(self) -> str | None:
        return None

    async def start(self, attempt: Attempt) -> EngineProcess:
        spec = self._adapter.launch_spec()
        extra = self._extra_args()
        if extra:
            spec = replace(spec, argv=[*spec.argv, *extra])
        if spec.socket is not None:
            spec.socket.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # A socket file left by a killed engine would make the new bind fail.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec.socket)
        with attempt.stage("spawn"):
            return EngineProcess.spawn(spec)

    def expected_canary(self) -> CanaryRecord | None:
        return None

    async def after_verified(self, engine: EngineProcess) -> None:
        return None

    def failed(self, reason: str) -> None:
        return None
