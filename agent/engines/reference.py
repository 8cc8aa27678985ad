"""The adapter for the reference engine (agent.engines.refengine), run as a child Python."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import agent
from agent.config import Config
from agent.engines.base import Detached, LaunchSpec
from agent.engines.refengine.protocol import Prefill
from agent.extras import Extra, require
from agent.refusal import Refusal
from agent.store.manifest import CanaryMethod

if TYPE_CHECKING:
    from agent.engines.probe import EngineProbe

# The reference engine's control endpoints (agent/engines/refengine/server.py).
PREPARE_PATH = "/pitstop/prepare"
RESUME_PATH = "/pitstop/resume"
# The longest a detach or a resume may take: the reference engine gives back caches and
# unmaps or maps its held weights.
CONTROL_LIMIT_S = 60.0


class ReferenceAdapter:
    """Starts `python -m agent.engines.refengine` on the configured model and Unix socket."""

    kind = "reference"
    health_path = "/health"
    metrics_path = None
    dead_marker = None
    # One forward call for the prompt, then decode steps from CUDA graphs: the canary costs
    # what a real request costs (one read of the weights a token), not one read a prompt token.
    canary_method = CanaryMethod.ONE_PASS_PREFILL
    control_limit_s = CONTROL_LIMIT_S

    def __init__(self, config: Config) -> None:
        _check_extra(config)
        self._config = config

    def reconfigure(self, config: Config) -> None:
        _check_extra(config)
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

    def canary_fields(self, method: CanaryMethod) -> dict[str, Any]:
        if method is CanaryMethod.ONE_PASS_PREFILL:
            return {"prefill": Prefill.ONE_PASS.value}
        return {}

    def exit_is_failure(self, returncode: int) -> bool:
        return True

    def kv_claimed_in_holder(self) -> bool:
        # refengine keeps its KV pool in the holder whenever it has one, unless told not to.
        return self._config.holder.enabled and "--no-keep-kv" not in self._config.engine.args

    def holder_refusal(self) -> Refusal | None:
        return None

    def warm_refusal(self, regions: list[str]) -> Refusal | None:
        return None  # it holds the files' bytes, which every start maps as they are

    def held_keys(self, digest: str) -> list[str]:
        return [digest]  # one process, one held set

    def image_refusal(self) -> Refusal | None:
        return None

    def one_worker_refusal(self, rung: str) -> Refusal | None:
        return None

    def holder_args(self, socket: Path, digest: str) -> list[str]:
        # Its own socket names the kept KV pool: the same for every engine this agent starts,
        # another for each agent of a node that shares the holder (check-config refuses two
        # engines on one socket).
        return ["--holder", str(socket), "--weights-digest", digest,
                "--kv-owner", str(self._config.engine_socket)]

    async def detach(self, probe: EngineProbe) -> Detached:
        answer = await probe.control(PREPARE_PATH, timeout=CONTROL_LIMIT_S)
        return Detached(freed_bytes=int(answer.get("freed_bytes", 0)),
                        held=(answer.get("held") or {}).get("regions") or None)

    async def resume(self, probe: EngineProbe) -> None:
        await probe.control(RESUME_PATH, timeout=CONTROL_LIMIT_S)


def _check_extra(config: Config) -> None:
    """Refuse at start, not in a restart loop, an engine that cannot import torch. Only the
    agent's own interpreter is looked at: engine.python is another, asked when it starts."""
    if config.engine.python is None:
        require(Extra.REFERENCE, "the reference engine (engine.kind: reference)")
