"""vLLM's warm path: the `vllm preload` weight-cache daemon, its health, the engine's flags."""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from agent.config import Config
from agent.engines.vllm.cli import cli_argv
from agent.errors import IdentityError, SourceUnavailable, VllmPreloadError
from agent.refusal import Refusal, RefusalCode

HEALTH_HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 2.0

# engine.args copied into the daemon's command line: the ones in vLLM's weight fingerprint
# (WeightCacheKey: dtype, quantization, revision, tensor parallel size; trust-remote-code and
# hf-overrides change the architecture it reads) and the two the daemon's warmup run needs.
# The value is how many arguments follow the flag.
WEIGHT_FLAGS = {
    "--dtype": 1, "--quantization": 1, "-q": 1, "--revision": 1,
    "--tensor-parallel-size": 1, "-tp": 1, "--trust-remote-code": 0, "--hf-overrides": 1,
    "--max-model-len": 1, "--enforce-eager": 0,
}


def weight_args(args: Sequence[str]) -> list[str]:
    """The WEIGHT_FLAGS among `args` (engine.args), with their values, in order."""
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        n = WEIGHT_FLAGS.get(flag)
        if n is not None:
            take = 1 if "=" in args[i] else 1 + n
            out.extend(args[i:i + take])
            i += take
        else:
            i += 1
    return out


def gpu_index(gpu: str, index_of_uuid: Callable[[str], int] | None = None) -> int:
    """The NVML index of `gpu` (an index, or a UUID as nvidia-smi -L prints it)."""
    if gpu.isdigit():
        return int(gpu)
    if index_of_uuid is None:
        index_of_uuid = _nvml_index
    return index_of_uuid(gpu)


def _nvml_index(uuid: str) -> int:
    from agent.identity import _nvml_module

    nv = _nvml_module()
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        raise SourceUnavailable(f"NVML: {e}: cannot map GPU {uuid} to its index") from e
    try:
        return int(nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid)))
    except nv.NVMLError as e:
        raise IdentityError(f"no GPU {uuid}: {e}; `nvidia-smi -L` lists the UUIDs") from e
    finally:
        nv.nvmlShutdown()


def health_port(config: Config, index: int) -> int:
    """The daemon for GPU `index` answers on vllm.preload.health_port + index."""
    return config.vllm.preload.health_port + index


def daemon_argv(config: Config, python: str, index: int) -> list[str]:
    """`vllm preload` for one GPU: the engine's model and weight flags, Pitstop's socket
    directory and a loopback health port.

    Example::

        daemon_argv(cfg, "/opt/vllm/bin/python", 0)
        # [py, '-c', SHIM, 'preload', '--model', '/models/qwen', '--dtype', 'bfloat16', ...,
        #  '--weight-cache-socket-dir', '/run/pitstop/vllm-preload',
        #  '--weight-cache-health-host', '127.0.0.1', '--weight-cache-health-port', '8470']
    """
    pre = config.vllm.preload
    return cli_argv(python, [
        "preload", "--model", str(config.engine.model), *weight_args(config.engine.args),
        *pre.args, "--weight-cache-socket-dir", str(pre.socket_dir),
        "--weight-cache-health-host", HEALTH_HOST,
        "--weight-cache-health-port", str(health_port(config, index)),
    ])


def daemon_env(config: Config, gpu: str) -> dict[str, str]:
    """The daemon sees only its GPU; the engine's environment otherwise (same dtype, caches)."""
    from agent.engines.vllm.adapter import BASE_ENV

    return {**BASE_ENV, **config.engine.env, "CUDA_VISIBLE_DEVICES": gpu}


def engine_args(config: Config) -> list[str]:
    """What the engine gets when it maps the daemon's weights.

    fallback false: when the daemon's weights don't fit (fingerprint mismatch) the engine
    fails instead of quietly reading disk, so the ladder falls to a cold start and logs why.
    """
    extra = {"socket_dir": str(config.vllm.preload.socket_dir), "fallback": False}
    return ["--load-format", "ipc_cache", "--model-loader-extra-config",
            json.dumps(extra, separators=(",", ":"))]


def check_health(port: int, host: str = HEALTH_HOST,
                 timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when the daemon answers GET /health with 200; otherwise why not, in words."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
    except ConnectionRefusedError:
        return f"nothing listens on {host}:{port}"
    except (OSError, http.client.HTTPException) as e:
        return f"{host}:{port} did not answer /health: {e}"
    finally:
        conn.close()
    if status == 200:
        return None
    if status == 503:
        return f"{host}:{port}/health answers 503: still loading the weights, or a rank died"
    return f"{host}:{port}/health answers {status}"


class PreloadLink:
    """Whether this engine's GPU has a healthy `vllm preload` daemon, and the flags to use it.

    Example::

        link = PreloadLink(config, gpu=lambda: "0")
        link.unavailable()  # None, or why the vllm-preload rung is skipped
        link.engine_args()  # ['--load-format', 'ipc_cache', '--model-loader-extra-config', ...]
    """

    def __init__(self, config: Config, gpu: Callable[[], str | None],
                 index_of_uuid: Callable[[str], int] | None = None) -> None:
        self.config = config
        self._gpu = gpu
        self._index_of_uuid = index_of_uuid

    def unit(self, gpu: str) -> str:
        return f"pitstop-vllm-preload@{gpu}.service"

    def unavailable(self) -> Refusal | None:
        if not self.config.vllm.preload.enabled:
            return Refusal(RefusalCode.DISABLED, "vllm.preload.enabled is false")
        gpu = self._gpu()
        if gpu is None:
            return Refusal(RefusalCode.NO_GPU, "CUDA_VISIBLE_DEVICES hides every GPU: there is "
                           "no daemon to map weights from")
        try:
            port = health_port(self.config, gpu_index(gpu, self._index_of_uuid))
        except (IdentityError, ValueError) as e:
            return Refusal(RefusalCode.PRELOAD_DOWN,
                           f"cannot tell which daemon serves GPU {gpu}: {e}")
        reason = check_health(port)
        if reason is None:
            return None
        return Refusal(RefusalCode.PRELOAD_DOWN,
                       f"the vLLM weight-cache daemon for GPU {gpu} is not healthy: {reason}; "
                       f"`systemctl status {self.unit(gpu)}`")

    def engine_args(self) -> list[str]:
        return engine_args(self.config)


def engine_gpu(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """The engine's GPU as CUDA_VISIBLE_DEVICES names it (its first entry), "0" when unset."""
    from agent.identity import gpu_selector

    env = {**(os.environ if environ is None else environ), **config.engine.env}
    sel = gpu_selector(env)
    return None if sel is None else str(sel)


def run_daemon(config: Config, python: str, gpu: str, *,
               index_of_uuid: Callable[[str], int] | None = None,
               poll_s: float = 1.0) -> int:
    """Run `vllm preload` for `gpu` in the foreground, as its systemd unit does: READY=1 once
    its /health answers 200, SIGTERM passed on, its exit status returned."""
    import signal
    import subprocess
    import time

    from agent.systemd import Notifier

    if not config.vllm.preload.enabled:
        raise VllmPreloadError("vllm.preload.enabled is false in the configuration; set it "
                               "to true (and restart the agent) before starting the daemon")
    port = health_port(config, gpu_index(gpu, index_of_uuid))
    socket_dir = Path(config.vllm.preload.socket_dir)
    socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = daemon_argv(config, python, gpu_index(gpu, index_of_uuid))
    notifier = Notifier()
    try:
        child = subprocess.Popen(argv, env={**os.environ, **daemon_env(config, gpu)},
                                 stdin=subprocess.DEVNULL)
    except OSError as e:
        raise VllmPreloadError(f"cannot start `vllm preload` with {python}: {e.strerror}; "
                               "check engine.python") from e

    def forward(sig: int, _frame: object) -> None:
        child.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    notifier.status(f"loading {config.engine.model} on GPU {gpu}")
    ready = False
    while child.poll() is None:
        if not ready and check_health(port) is None:
            ready = True
            notifier.ready(f"serving GPU {gpu}: health on {HEALTH_HOST}:{port}")
        time.sleep(poll_s)
    return child.returncode
