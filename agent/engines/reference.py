"""The adapter for the reference engine (agent.engines.refengine), run as a child Python."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import agent
from agent.config import Config
from agent.engines.base import LaunchSpec, Prepared

if TYPE_CHECKING:
    from agent.supervisor.probe import EngineProbe

# The reference engine's control endpoints (agent/engines/refengine/server.py).
PREPARE_PATH = "/pitstop/prepare"
RESUME_PATH = "/pitstop/resume"


class ReferenceAdapter:
    """Starts `python -m agent.engines.refengine` on the configured model and Unix socket."""

    kind = "reference"
    health_path = "/health"
    metrics_path = None
    dead_marker = None

    def __init__(self, config: Config) -> None:
        self._config = config

    def reconfigure(self, config: Config) -> None:
        self._config = config

    def launch_spec(self) -> LaunchSpec:
        eng = self._config.engine
        python = str(eng.python) if eng.python else sys.executable
        argv = [
            python,
            "-m",
            "agent.engines.refengine",
            "--model",
            str(eng.model),
            "--uds",
            str(self._config.engine_socket),
            "--served-model-name",
            eng.model_name,
            "--device",
            eng.device,
            *eng.args,
        ]
        return LaunchSpec(argv=argv, env=dict(eng.env), socket=self._config.engine_socket)

    def version(self) -> str:
        return agent.__version__

    def model_name(self) -> str:
        return self._config.engine.model_name

    def exit_is_failure(self, returncode: int) -> bool:
        return True

    def holder_refusal(self) -> str | None:
        return None

    def holder_args(self, socket: Path, digest: str) -> list[str]:
        return ["--holder", str(socket), "--weights-digest", digest]

    async def prepare(self, probe: EngineProbe) -> Prepared:
        answer = await probe.control(PREPARE_PATH)
        return Prepared(freed_bytes=int(answer.get("freed_bytes", 0)),
                        held=(answer.get("held") or {}).get("regions") or None)

    async def resume(self, probe: EngineProbe) -> None:
        await probe.control(RESUME_PATH)
