"""The YAML configuration file, validated into frozen typed objects; no other I/O."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.errors import ConfigError

DEFAULT_NAME = "<embedded default>"


class _Strict(BaseModel):
    # Unknown keys are typos far more often than intent: refuse them.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


def _expand(value: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(value)))


# A path from the file: `~` and `$VARS` expanded (strings only: a Path object is kept as is).
ExpandedPath = Annotated[Path, BeforeValidator(lambda v: _expand(v) if isinstance(v, str) else v)]


class CanaryConfig(_Strict):
    """The fixed request whose greedy answer proves the engine is really the one we started."""

    prompt: str = "Pitstop canary: the quick brown fox"
    max_tokens: int = Field(8, ge=1, le=256)


class EngineConfig(_Strict):
    """What engine to run, on what model, listening where."""

    kind: Literal["reference", "vllm"] = "reference"
    model: ExpandedPath
    served_model_name: str | None = None
    socket: ExpandedPath | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    python: ExpandedPath | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    stop_timeout_s: float = Field(10.0, gt=0)
    # A small Pitstop process stays the root of the engine's process tree (vLLM only): CRIU
    # then restores the engine's own processes in parallel (agent/deathsig.py says why).
    small_root: bool = True

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name


class TlsConfig(_Strict):
    """TLS on a public port: a certificate chain and its key, optionally client certificates."""

    cert_file: ExpandedPath | None = None
    key_file: ExpandedPath | None = None
    # Mutual TLS: clients must present a certificate signed by one of these CAs.
    client_ca_file: ExpandedPath | None = None

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class QueueConfig(_Strict):
    """How the front holds requests while the engine is down."""

    max_waiting: int = Field(256, ge=0)
    deadline_s: float = Field(30.0, gt=0)
    # What a 503 tells the client to wait before it tries again.
    retry_after_s: int = Field(5, ge=1)


class FrontConfig(_Strict):
    """The public OpenAI-compatible port, owned by the agent."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    max_resumes: int = Field(3, ge=0)
    # How long an answer cut by an engine crash waits for the recovered engine: longer than
    # the queue deadline, since its client is already being served and a cold start of a
    # big model takes minutes.
    resume_wait_s: float = Field(120.0, gt=0)
    # Largest request body accepted (long prompts as token id lists are big).
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # How long a client may take to send its whole request body: a client that stops
    # half-way gets a 408 instead of holding a connection and a handler forever.
    body_timeout_s: float = Field(30.0, gt=0)
    # API keys, one a line, in a file only the agent's user may read; never in this file.
    api_key_file: ExpandedPath | None = None
    tls: TlsConfig = Field(default_factory=TlsConfig)


class PathsConfig(_Strict):
    """Where the agent keeps its state and snapshots."""

    state_dir: ExpandedPath = Path("/var/lib/pitstop")
    snapshot_dir: ExpandedPath | None = None
    run_dir: ExpandedPath | None = None


    @property
    def snapshots(self) -> Path:
        return self.snapshot_dir or self.state_dir / "snapshots"

    @property
    def run(self) -> Path:
        return self.run_dir or self.state_dir / "run"


# S3 bucket names: 3-63 lowercase letters, digits, dots and hyphens (the AWS naming rules).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Url:
    """`s3://bucket/prefix`: where a fleet's snapshots live in an S3-compatible store.

    Example::

        u = S3Url.parse("s3://fleet-snapshots/llama-8b")
        u.bucket, u.prefix, u.key("manifests", "x.json")  # ..., 'llama-8b/manifests/x.json'
    """

    bucket: str
    prefix: str  # no slash at either end; "" for the whole bucket

    @classmethod
    def parse(cls, text: str) -> S3Url:
        """The URL's parts; ValueError saying what is wrong with it."""
        if not text.startswith("s3://"):
            raise ValueError(f"{text!r} is not an s3:// URL; write s3://BUCKET/PREFIX (the "
                             "endpoint comes from AWS_ENDPOINT_URL or ~/.aws/config)")
        bucket, _, prefix = text.removeprefix("s3://").partition("/")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ValueError(f"{bucket!r} is not an S3 bucket name (3-63 lowercase letters, "
                             "digits, dots and hyphens)")
        prefix = prefix.strip("/")
        if any(p in ("", ".", "..") for p in prefix.split("/")) and prefix:
            raise ValueError(f"prefix {prefix!r} of {text!r} has an empty, . or .. part")
        return cls(bucket, prefix)

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


class SnapshotsConfig(_Strict):
    """Where CRIU is and how many snapshots to keep (the directory is paths.snapshots)."""

    enabled: bool = True
    # Who takes and restores vLLM snapshots: Pitstop's CRIU backend, vLLM's own `vllm snapshot`
    # (settings under vllm.snapshot), or auto: vLLM's when the engine is vLLM, vllm.snapshot is
    # set, the installed vLLM has the subcommand and the host has CUDA; else Pitstop's.
    backend: Literal["auto", "pitstop", "vllm"] = "auto"
    # When a start found no usable snapshot: take one before the gate opens, at the first
    # quiet moment after it opens, or only on `pitstop snapshot create`.
    regenerate: Literal["before-serving", "after-serving", "manual"] = "after-serving"
    # How long a snapshot waits for requests in flight to finish (new ones are held).
    quiet_timeout_s: float = Field(30.0, gt=0)
    # How often the running agent recomputes the host identity (weights by stat, re-hashing
    # only changed files) to notice drift; 0 turns the watcher off.
    drift_check_interval_s: float = Field(30.0, ge=0)
    # Before a restore: hash only image files changed since they were sealed (inode, size,
    # mtime or ctime differ), or hash every file every time.
    verify: Literal["changed", "always"] = "changed"
    criu: ExpandedPath | None = None
    keep: int = Field(2, ge=1)
    disk_budget_gib: float = Field(64.0, gt=0)
    # Quarantined snapshots kept for a post-mortem, newest first, and only while they fit in
    # disk_budget_gib beside the published ones; 0 deletes each one as it is refused.
    quarantine_keep: int = Field(2, ge=0)
    cuda_lock_timeout_ms: int = Field(10_000, ge=1)
    # CRIU's log level (-v) for restores: 2 logs warnings and errors (an Error line names
    # why a restore failed); 4, its debug log, cost a vLLM restore 36-56 ms on the CPU (docs/
    # performance.md). Dumps log at 4.
    restore_log_level: int = Field(2, ge=0, le=4)
    # An S3-compatible store shared by a fleet (s3://bucket/prefix; credentials, region and
    # endpoint from the standard AWS variables and files): a start without a matching
    # local snapshot pulls one from it before it would cold-start (docs/snapshots.md).
    remote: str | None = None
    # Push each snapshot this agent publishes to `remote`: the first node seeds the fleet.
    publish: bool = False
    # The longest a pull may take (listing, download, verification) before the start gives
    # up on it and goes on down the ladder.
    pull_timeout_s: float = Field(900.0, gt=0)
    # Keep a stopped copy of the engine restored from the newest hybrid snapshot, beside the
    # live one in its own namespaces: a crash is answered by continuing it (the standby rung).
    standby: bool = False
    # Wake each standby as soon as it is restored (its processes run, idle, and their CUDA
    # state is restored onto the GPU, locked) instead of at the crash, which then costs no
    # CUDA restore; the price is the engine's own GPU memory while it waits.
    standby_woken: bool = False


    @field_validator("remote")
    @classmethod
    def _s3_url(cls, v: str | None) -> str | None:
        if v is not None:
            S3Url.parse(v)  # ValueError naming what is wrong
        return v

    @field_validator("drift_check_interval_s")
    @classmethod
    def _off_or_calm(cls, v: float) -> float:
        # Each check stats every model file and queries NVML: not a busy loop.
        if 0 < v < 1:
            raise ValueError("must be 0 (off) or at least 1 second")
        return v


class HolderConfig(_Strict):
    """The per-GPU memory holder the engine keeps its weights in (docs/holder.md)."""

    enabled: bool = False
    # Where `pitstop holder --dir` serves: <dir>/<gpu>/holder.sock. Default <run_dir>/holder.
    dir: ExpandedPath | None = None
    # The holder's id: a GPU UUID, or "cpu" for the memfd backend; auto picks the GPU's
    # UUID when the host has one, else "cpu".
    gpu: str = "auto"
    # The refill rung: when the holder lost the weights, it loads them again from the model
    # files (a plan the agent leaves in its directory) and the hybrid image is restored.
    refill: bool = True



_HEX40 = re.compile(r"^[0-9a-fA-F]{40}$")


class VllmSnapshotConfig(_Strict):
    """vLLM's own snapshots (`vllm snapshot create|restore`), when snapshots.backend picks them.

    `vllm snapshot create` refuses a local model directory: it snapshots a Hugging Face repo
    id at an immutable commit, which is why these are separate from engine.model.
    """

    model: str | None = None
    revision: str | None = None
    # `vllm snapshot restore` serves on TCP only; the agent relays engine.socket to this port.
    port: int = Field(8001, ge=1, le=65535)
    # Where CRIU's CUDA plugin (cuda_plugin.so) is: vLLM reads CRIU_CUDA_PLUGIN_DIR.
    cuda_plugin_dir: ExpandedPath | None = None
    # vLLM's own limit for each step of a create or restore (VLLM_SNAPSHOT_TIMEOUT_S).
    timeout_s: float = Field(900.0, gt=0)


    @field_validator("model")
    @classmethod
    def _remote(cls, v: str | None) -> str | None:
        if v is not None and (v.startswith(("/", ".", "~")) or v.count("/") != 1):
            raise ValueError("must be a Hugging Face repo id like Qwen/Qwen3-0.6B: `vllm "
                             "snapshot create` refuses a local model directory")
        return v

    @field_validator("revision")
    @classmethod
    def _commit(cls, v: str | None) -> str | None:
        if v is not None and not _HEX40.match(v):
            raise ValueError("must be the model's 40-character commit hash (vLLM snapshots "
                             "an immutable revision, not a branch or tag)")
        return v


class VllmPreloadConfig(_Strict):
    """vLLM's weight-cache daemon (`vllm preload`, one per GPU; docs/vllm.md)."""

    enabled: bool = False
    # Where the daemons put their Unix sockets (--weight-cache-socket-dir); private, root's.
    socket_dir: ExpandedPath = Path("/run/pitstop/vllm-preload")
    # The daemon for GPU index i answers GET /health on 127.0.0.1:(health_port + i).
    health_port: int = Field(8470, ge=1, le=65000)
    # Extra daemon arguments, after the weight-defining ones copied from engine.args.
    args: list[str] = Field(default_factory=list)



class VllmPluginConfig(_Strict):
    """Pitstop's vLLM plugin (the hybrid, refill and warm rungs; docs/vllm.md, section 8)."""

    # A vLLM series the plugin was not tested against: `probe` serves it when every vLLM
    # internal the plugin uses is there, `refuse` keeps to the tested series.
    untested: Literal["probe", "refuse"] = "probe"


class VllmConfig(_Strict):
    """vLLM-only paths: its own snapshots, its weight-cache daemon, Pitstop's plugin."""

    snapshot: VllmSnapshotConfig = Field(default_factory=VllmSnapshotConfig)
    preload: VllmPreloadConfig = Field(default_factory=VllmPreloadConfig)
    plugin: VllmPluginConfig = Field(default_factory=VllmPluginConfig)


# engine.args that would contradict the preload path (Pitstop sets the first two; vLLM's
# zero-copy IPC loader must not be combined with sleep mode, which offloads weights).
PRELOAD_OWNED_ENGINE_FLAGS = ("--load-format", "--model-loader-extra-config",
                              "--enable-sleep-mode")
# vllm.preload.args that Pitstop sets itself.
PRELOAD_OWNED_DAEMON_FLAGS = ("--model", "--weight-cache-socket-dir", "--weight-cache-health-port",
                              "--weight-cache-health-host", "--load-format")


# Why engine.args and engine.env may not hold an API key.
ENGINE_KEY_REFUSAL = (
    "an API key on the engine would make it refuse the agent's own health checks, canary "
    "and resumed streams over its private socket; remove it and put the keys in a file named "
    "by front.api_key_file (or in the agent's PITSTOP_API_KEY environment variable): the "
    "front checks them (docs/front.md, API keys)")


def _flag_index(args: list[str], flags: tuple[str, ...]) -> tuple[int, str] | None:
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in flags:
            return i, flag
    return None


class HealthConfig(_Strict):
    """How the supervisor decides the engine is alive."""

    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    failures_before_restart: int = Field(3, ge=1)
    start_timeout_s: float = Field(300.0, gt=0)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)


class RestartConfig(_Strict):
    """Backoff between restarts, and when to give up."""

    backoff_initial_s: float = Field(0.5, ge=0)
    backoff_max_s: float = Field(30.0, gt=0)
    backoff_multiplier: float = Field(2.0, ge=1)
    crash_loop_limit: int = Field(5, ge=1)
    crash_loop_window_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _initial_below_max(self) -> RestartConfig:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("backoff_initial_s must not exceed backoff_max_s")
        return self


class MetricsConfig(_Strict):
    """The Prometheus exposition endpoint."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(9410, ge=0, le=65535)
    # TLS and basic auth in the Prometheus exporter toolkit's web configuration format.
    web_config_file: ExpandedPath | None = None


class Config(_Strict):
    """The whole agent configuration.

    Example::

        cfg = load_config(Path("/etc/pitstop/pitstop.yaml"))
        cfg.engine.kind  # 'reference' or 'vllm'
    """

    engine: EngineConfig
    front: FrontConfig = Field(default_factory=FrontConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    snapshots: SnapshotsConfig = Field(default_factory=SnapshotsConfig)
    holder: HolderConfig = Field(default_factory=HolderConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)

    @model_validator(mode="after")
    def _access(self) -> Config:
        # Checked here, not in the sections: an error there would print the section's values.
        hit = _flag_index(self.engine.args, ("--api-key",))
        if hit is not None:
            raise ValueError(f"engine.args[{hit[0]}]: {ENGINE_KEY_REFUSAL}")
        if "VLLM_API_KEY" in self.engine.env:
            raise ValueError(f"engine.env.VLLM_API_KEY: {ENGINE_KEY_REFUSAL}")
        tls = self.front.tls
        if (tls.cert_file is None) != (tls.key_file is None):
            raise ValueError("front.tls.cert_file and front.tls.key_file go together: set "
                             "both to serve TLS, or neither")
        if tls.client_ca_file is not None and tls.cert_file is None:
            raise ValueError("front.tls.client_ca_file needs front.tls.cert_file and "
                             "key_file: client certificates are asked for in a TLS handshake")
        return self

    @model_validator(mode="after")
    def _vllm_paths(self) -> Config:
        # Errors start with the key they are about: _describe prints them as they are.
        vllm_engine = self.engine.kind == "vllm"
        if self.snapshots.backend == "vllm":
            if not vllm_engine:
                raise ValueError("snapshots.backend: vllm needs engine.kind: vllm (got "
                                 f"{self.engine.kind}); use pitstop or auto")
            snap = self.vllm.snapshot
            if snap.model is None or snap.revision is None:
                raise ValueError(
                    "snapshots.backend: vllm needs vllm.snapshot.model and vllm.snapshot.revision "
                    "(`vllm snapshot create` wants a Hugging Face repo id and its 40-character "
                    "commit, not a local directory)")
        if self.snapshots.standby_woken and not self.snapshots.standby:
            raise ValueError("snapshots.standby_woken: true needs snapshots.standby: true (it "
                             "says when the standby is woken: ahead of the crash or at it)")
        if self.snapshots.publish and self.snapshots.remote is None:
            raise ValueError("snapshots.publish: true needs snapshots.remote, the "
                             "s3://bucket/prefix to push to")
        pre = self.vllm.preload
        if pre.enabled:
            if not vllm_engine:
                raise ValueError("vllm.preload.enabled: the weight-cache daemon serves vLLM "
                                 f"engines only, and engine.kind is {self.engine.kind}")
            hit = _flag_index(self.engine.args, PRELOAD_OWNED_ENGINE_FLAGS)
            if hit is not None:
                raise ValueError(
                    f"engine.args[{hit[0]}]: {hit[1]} conflicts with vllm.preload.enabled: "
                    "Pitstop starts the preload rung with --load-format ipc_cache and "
                    "--model-loader-extra-config, and vLLM's zero-copy loader cannot be "
                    "combined with sleep mode; remove it, or turn vllm.preload off")
            hit = _flag_index(pre.args, PRELOAD_OWNED_DAEMON_FLAGS)
            if hit is not None:
                raise ValueError(
                    f"vllm.preload.args[{hit[0]}]: {hit[1]} is set by Pitstop from engine.model "
                    "and vllm.preload.socket_dir/health_port; remove it")
        return self

    @property
    def engine_socket(self) -> Path:
        return self.engine.socket or self.paths.run / "engine.sock"


# Keys a release took away, and what a configuration that still sets one should do.
REMOVED_KEYS = {
    "snapshots.lazy_restore": "no longer a key: CRIU's lazy restore made every restore "
    "measured slower (vLLM and the reference engine, on CPU and on GPUs: the first answer "
    "touches most of the engine's memory, which then arrives page by page); remove it",
}


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden" and key in REMOVED_KEYS:
        return f"{key}: {REMOVED_KEYS[key]}"
    if kind == "extra_forbidden":
        return f"{key}: unknown key; remove it or check its spelling against docs/configuration.md"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "value_error" and not err["loc"]:
        # A check across sections names its keys itself; the whole input would only blur it.
        return str(err["ctx"]["error"])
    return f"{key}: {err['msg']} (got {err.get('input')!r})"


def parse_config(data: Any, source: str) -> Config:
    """Validate already-parsed YAML; `source` names the file in every error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = "\n  ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"{source}: invalid configuration:\n  {lines}") from None


def parse_text(text: str, source: str) -> Config:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    return parse_config(data, source)


def load_config(path: Path | None) -> Config:
    """Load `path`, or the embedded default (reference engine, tiny model) when None."""
    if path is None:
        return parse_text(default_text(), DEFAULT_NAME)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration file: {e.strerror}") from None
    return parse_text(text, str(path))


def default_text() -> str:
    return resources.files("agent").joinpath("default.yaml").read_text()
