"""Cold start: launch the engine from nothing. Always available; the ladder's last rung."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import replace

from agent.engines.base import EngineAdapter
from agent.refusal import Refusal
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt, Prepared

# A fresh start's plan: the arguments added to the engine's own (the holder's socket).
ExtraArgs = tuple[str, ...]


class ColdStart:
    """Start the engine the way it would start without Pitstop."""

    name = "cold"
    reuses_held_memory = False

    def __init__(self, adapter: EngineAdapter,
                 extra_args: Callable[[], list[str]] = lambda: []) -> None:
        self._adapter = adapter
        # Arguments decided at start time (the holder's socket when one answers); it may
        # ask the holder, so it runs in a worker thread.
        self._extra_args = extra_args

    async def prepare(self, attempt: Attempt) -> Prepared[ExtraArgs] | Refusal:
        return Prepared(self.name, tuple(await asyncio.to_thread(self._extra_args)))

    async def start(self, attempt: Attempt, prepared: Prepared[ExtraArgs]) -> EngineProcess:
        spec = self._adapter.launch_spec()
        if prepared.plan:
            spec = replace(spec, argv=[*spec.argv, *prepared.plan])
        if spec.socket is not None:
            spec.socket.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # A socket file left by a killed engine would make the new bind fail.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec.socket)
        with attempt.stage("spawn"):
            return EngineProcess.spawn(spec, self._adapter.health_path)

    def start_limit_s(self, prepared: Prepared[ExtraArgs]) -> float:
        # Starting the process is all of it; the engine's load is the health wait's.
        return 0.0

    async def after_verified(self, engine: EngineProcess,
                             prepared: Prepared[ExtraArgs]) -> None:
        return None

    async def failed(self, prepared: Prepared[ExtraArgs], reason: str) -> None:
        return None
