"""vLLM's own snapshots as a backend: `vllm snapshot create|inspect|restore` as subprocesses."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import commands
from agent.checkpoint.backend import BackendName, CreateRequest, Image, RestoredProcess
from agent.checkpoint.criu_locate import MIN_TEXT
from agent.commands import CommandResult, Runner
from agent.config import Config
from agent.engines.vllm.cli import VllmFeatures, cli_argv, last_error, usage_error
from agent.errors import CommandError, VllmSnapshotError
from agent.refusal import Refusal, RefusalCode
from agent.store import Canary, Manifest, ProcessTree, Skipped, SnapshotKind

# vLLM's SnapshotRuntimeIdentity field -> the name Pitstop's drift reports use for the same
# fact (agent.identity.Identity). cuda_runtime and host_id have no Pitstop counterpart.
FIELD_MAP = {
    "vllm_version": "engine_version",
    "python_version": "python",
    "torch_version": "torch",
    "cuda_runtime": "cuda_runtime",
    "driver_version": "driver_version",
    "criu_version": "criu",
    "cuda_checkpoint_sha256": "cuda_checkpoint",
    "kernel_release": "kernel",
    "host_id": "host_id",
    "gpu_name": "gpu_name",
    "gpu_uuid": "gpu_uuid",
    "environment": "env",
}
# A vLLM snapshot is a snapshot of Pitstop's store (kind vllm) holding vLLM's artifact in
# this subdirectory: <paths.snapshots>/<id>/vllm/{manifest.json,images/,child.log,...}.
SUBDIR = "vllm"
# What `vllm snapshot restore` writes into the artifact each time (vllm/snapshot/runtime.py:
# the release marker, the restored root's pidfile, CRIU's restore log and stats; child.log is
# cut back to its size at the dump, then the restored engine writes to it again).
SCRATCH = tuple(f"{SUBDIR}/{n}" for n in (
    "release.json", "release.json.tmp", "restored.pid", "child.log", "images/restore.log",
    "images/stats-restore"))
# What `vllm snapshot inspect` printed when the snapshot was taken, kept beside the artifact
# (<id>/vllm-inspect.json) and sealed with it: each later reading would cost vLLM's import
# (the first restore after an agent start spent 23.4 s choosing a 32 GiB model's snapshot on
# an H100, nearly all of it that import).
INSPECTED = "vllm-inspect.json"
# vLLM's canary request (vllm/snapshot/runtime.py `request_oracle`): one greedy token.
ORACLE_PROMPT = "The capital of France is"
INSPECT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class VllmManifest:
    """What `vllm snapshot inspect` says about one snapshot directory.

    Example::

        m = backend.inspect(path)
        m.identity["gpu_uuid"], m.engine_argv, m.canary_text
    """

    path: Path
    created_at: str
    model: str
    model_revision: str
    served_model_name: str
    engine_argv: tuple[str, ...]
    identity: dict[str, Any]
    root_pid: int
    canary_text: str
    artifact_bytes: int
    pids: tuple[int, ...] = ()
    cuda_pids: tuple[int, ...] = ()
    canary_token_ids: tuple[int, ...] = ()

    @property
    def id(self) -> str:
        # The store's snapshot id when the artifact is in the store (<id>/vllm).
        return self.path.parent.name if self.path.name == SUBDIR else self.path.name

    @classmethod
    def from_inspect(cls, path: Path, data: dict[str, Any]) -> VllmManifest:
        try:
            return cls(
                path=path, created_at=data["created_at"], model=data["model"],
                model_revision=data["model_revision"],
                served_model_name=data["served_model_name"],
                engine_argv=tuple(data["engine_argv"]),
                identity={k: data[k] for k in FIELD_MAP},
                root_pid=int(data["process_tree"][0]), canary_text=data["oracle_text"],
                artifact_bytes=int(data["artifact_bytes"]),
                pids=tuple(int(p) for p in data["process_tree"]),
                cuda_pids=tuple(int(p) for p in data["cuda_holders"]),
                canary_token_ids=tuple(int(t) for t in data["oracle_token_ids"]))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise VllmSnapshotError(
                f"corrupt: `vllm snapshot inspect {path}` printed a manifest without {e}; this "
                "vLLM's manifest format is not one Pitstop knows (schema_version 1)",
                RefusalCode.CORRUPT) from e


def pitstop_field(vllm_field: str) -> str:
    """How a drift report names vLLM's identity field (`kernel (vLLM: kernel_release)`)."""
    ours = FIELD_MAP.get(vllm_field, vllm_field)
    return ours if ours == vllm_field else f"{ours} (vLLM: {vllm_field})"


def child_argv(create_args: Sequence[str]) -> tuple[str, ...]:
    """The engine argv vLLM records for `vllm snapshot create ARGS`: --snapshot-dir dropped,
    --enable-sleep-mode added (vllm/snapshot/controller.py `_child_engine_argv`)."""
    out: list[str] = []
    it = iter(create_args)
    for item in it:
        if item.split("=", 1)[0] == "--snapshot-dir":
            if "=" not in item:
                next(it, None)
            continue
        out.append(item)
    if "--enable-sleep-mode" not in out:
        out.append("--enable-sleep-mode")
    return tuple(out)


def map_failure(action: str, path: Path, returncode: int, stderr: str) -> VllmSnapshotError:
    """A failed `vllm snapshot ACTION` as Pitstop's error: what went wrong and what to do."""
    what = f"vllm snapshot {action} {path}"
    usage = usage_error(stderr)
    if returncode == 2 and usage is not None:
        if "invalid choice: 'snapshot'" in usage:
            return VllmSnapshotError(
                "unsupported: the installed vLLM has no `vllm snapshot` subcommand; install a "
                "vLLM that has it (0.32+) or set snapshots.backend: pitstop",
                RefusalCode.UNSUPPORTED)
        return VllmSnapshotError(f"{what}: vLLM refused its arguments: {usage}",
                                 RefusalCode.INVALID_ARGS)
    err = last_error(stderr)
    if err is None:
        tail = " | ".join(stderr.strip().splitlines()[-3:]) or "no output"
        return VllmSnapshotError(f"{what} exited with {returncode}: {tail}")
    return (_refused(what, path, err.cls, err.message) or _missing(what, err.cls, err.message)
            or VllmSnapshotError(f"{what} failed: {err.cls}: {err.message}"))


def _refused(what: str, path: Path, cls: str, msg: str) -> VllmSnapshotError | None:
    """vLLM's own snapshot errors: the snapshot stale, corrupt, not private, its canary
    answered otherwise, or its PIDs taken; None for another error."""
    if cls == "SnapshotCompatibilityError" and msg.startswith("snapshot mismatch:"):
        fields = [f.strip() for f in msg.split(":", 1)[1].split(",") if f.strip()]
        return VllmSnapshotError(
            f"stale: vLLM refused snapshot {path.name}: {', '.join(map(pitstop_field, fields))} "
            "differ from this host; take a new one (`pitstop vllm-snapshot create`)",
            RefusalCode.STALE)
    if cls == "SnapshotCompatibilityError":
        return VllmSnapshotError(f"corrupt: {what}: {msg}; delete {path} and take a new one",
                                 RefusalCode.CORRUPT)
    if cls == "SnapshotSecurityError":
        if "does not exist" in msg:
            return VllmSnapshotError(f"{what}: {msg}", RefusalCode.NOT_FOUND)
        return VllmSnapshotError(
            f"permissions: {what}: {msg}; vLLM wants the directory mode 0700, owned by the "
            "agent's user, with no symlink or group/world-writable directory above it",
            RefusalCode.PERMISSIONS)
    if cls == "SnapshotRestoreError" and "oracle mismatch" in msg:
        return VllmSnapshotError(
            f"canary: the engine restored from {path.name} answered vLLM's canary differently "
            f"than when it was taken ({msg}); the snapshot is not used again", RefusalCode.CANARY)
    if cls == "SnapshotRestoreError" and "already occupied" in msg:
        return VllmSnapshotError(
            f"{what}: {msg}: a process restored from a snapshot gets its old PIDs back; stop "
            "the process holding it (an engine restored earlier?)", RefusalCode.PID_TAKEN)
    return None


def _missing(what: str, cls: str, msg: str) -> VllmSnapshotError | None:
    """What the host lacks for vLLM's snapshots (CUDA, CRIU, its CUDA plugin, Linux) or
    the engine arguments it refused; None for another error."""
    m = re.match(r"snapshot dependency not found: (\S+)", msg)
    if m and m.group(1) in ("cuda-checkpoint", "nvidia-smi"):
        return VllmSnapshotError(
            f"no_cuda: {what}: `{m.group(1)}` is not on PATH: vLLM's snapshots need an NVIDIA "
            "GPU with its driver and the cuda-checkpoint binary", RefusalCode.NO_CUDA)
    if m:
        return VllmSnapshotError(
            f"{what}: `{m.group(1)}` is not on PATH: vLLM runs CRIU by that name; set "
            "snapshots.criu (Pitstop puts its directory first on PATH) or install CRIU >= "
            f"{MIN_TEXT}",
            RefusalCode.NO_CRIU)
    if "CRIU_CUDA_PLUGIN_DIR" in msg or "CRIU CUDA plugin" in msg:
        return VllmSnapshotError(
            f"{what}: {msg}: set vllm.snapshot.cuda_plugin_dir to the directory holding CRIU's "
            "cuda_plugin.so", RefusalCode.NO_CUDA_PLUGIN)
    if cls == "ValueError" and msg.startswith("snapshot"):
        return VllmSnapshotError(f"{what}: vLLM refused the engine arguments: {msg}",
                                 RefusalCode.INVALID_ARGS)
    if "requires Linux" in msg:
        return VllmSnapshotError(f"unsupported: {what}: {msg}", RefusalCode.UNSUPPORTED)
    return None


class VllmSnapshotBackend:
    """vLLM's own snapshots as a checkpoint backend: `vllm snapshot create` makes the image
    (vLLM starts an engine of its own and dumps it), `vllm snapshot restore` brings it back.

    Each is a snapshot of Pitstop's store, kind `vllm`, with vLLM's artifact under `vllm/`:
    the store seals and publishes it, verifies it before use, quarantines and prunes it like
    any other. vLLM records the artifact's path in the dumped tree (its log, its release
    marker), so the store stages it under its final name (`in_place`).

    Example::

        b = VllmSnapshotBackend.from_config(config, python="/opt/vllm/bin/python")
        info = take(store, b, CreateRequest("vllm"), identity)
        restored = b.restore(info.manifest, info.path)  # serves on 127.0.0.1:vllm.snapshot.port
    """

    name = BackendName.VLLM
    kinds: frozenset[SnapshotKind] = frozenset({"vllm"})
    in_place = True
    # `vllm snapshot restore` takes no GPU pairs: every identity field must match.
    remaps: frozenset[str] = frozenset()

    def __init__(self, *, python: str, model: str, revision: str,
                 served_model_name: str, engine_args: Sequence[str], engine_env: Mapping[str, str],
                 port: int, timeout_s: float, cuda_plugin_dir: Path | None = None,
                 criu: Path | None = None, run: Runner = commands.run) -> None:
        self.python = python
        self.model = model
        self.revision = revision
        self.served_model_name = served_model_name
        self.engine_args = tuple(engine_args)
        self.engine_env = dict(engine_env)
        self.port = port
        self.timeout_s = timeout_s
        self.cuda_plugin_dir = cuda_plugin_dir
        self.criu = criu
        self._run = run
        self._inspected: dict[Path, tuple[tuple, VllmManifest]] = {}

    @classmethod
    def from_config(cls, config: Config, *, python: str, criu: Path | None = None,
                    run: Runner = commands.run) -> VllmSnapshotBackend:
        snap = config.vllm.snapshot
        if snap.model is None or snap.revision is None:
            raise VllmSnapshotError(
                "vllm.snapshot.model and vllm.snapshot.revision are not set: vLLM's snapshots "
                "need the Hugging Face repo id and its 40-character commit",
                RefusalCode.DISABLED)
        from agent.engines.vllm.adapter import BASE_ENV

        return cls(python=python, model=snap.model,
                   revision=snap.revision, served_model_name=config.engine.model_name,
                   engine_args=config.engine.args,
                   engine_env={**BASE_ENV, **config.engine.env}, port=snap.port,
                   timeout_s=snap.timeout_s, cuda_plugin_dir=snap.cuda_plugin_dir, criu=criu,
                   run=run)

    @property
    def create_limit_s(self) -> float:
        # vLLM's create starts an engine, warms it and dumps it: several of its own steps,
        # each allowed vllm.snapshot.timeout_s.
        return self.timeout_s * 4

    @property
    def restore_limit_s(self) -> float:
        return self.timeout_s * 3

    @staticmethod
    def artifact(image: Path) -> Path:
        """vLLM's artifact inside a snapshot directory of the store."""
        return image / SUBDIR

    # --- command lines ---------------------------------------------------------------------
    def create_args(self, target: Path) -> list[str]:
        """`vllm snapshot create` arguments: the remote model at its commit, the engine's args."""
        return [self.model, "--revision", self.revision,
                "--served-model-name", self.served_model_name, *self.engine_args,
                "--snapshot-dir", str(target)]

    def argv(self, action: str, path: Path) -> list[str]:
        if action == "create":
            return cli_argv(self.python, ["snapshot", "create", *self.create_args(path)])
        if action == "inspect":
            return cli_argv(self.python, ["snapshot", "inspect", str(path)])
        if action == "restore":
            # Loopback only: the agent's front is the public side (docs/vllm.md).
            return cli_argv(self.python, ["snapshot", "restore", str(path),
                                          "--host", "127.0.0.1", "--port", str(self.port)])
        raise ValueError(f"unknown vllm snapshot action {action!r}")

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a vLLM snapshot command: the engine's, with vLLM's own knobs."""
        env = {**(os.environ if base is None else base), **self.engine_env,
               "VLLM_SNAPSHOT_TIMEOUT_S": f"{self.timeout_s:g}"}
        if self.cuda_plugin_dir is not None:
            env["CRIU_CUDA_PLUGIN_DIR"] = str(self.cuda_plugin_dir)
        if self.criu is not None and self.criu.name == "criu":
            # vLLM runs `criu` from PATH; Pitstop's located CRIU comes first.
            env["PATH"] = f"{self.criu.parent}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def expected_argv(self) -> tuple[str, ...]:
        """The engine argv a snapshot taken with this configuration records."""
        return child_argv(self.create_args(Path("unused")))

    # --- running vLLM ---------------------------------------------------------------------
    def _call(self, action: str, path: Path, timeout: float) -> CommandResult:
        argv = self.argv(action, path)
        try:
            done = self._run(argv, timeout_s=timeout, check=False, env=self.env())
        except CommandError as e:
            # It could not start, or ran past its time and was killed.
            raise VllmSnapshotError(f"vllm snapshot {action} {path}: {str(e)[-500:]}; check "
                                    "engine.python and vllm.snapshot.timeout_s",
                                    RefusalCode.FAILED) from e
        if done.returncode != 0:
            raise map_failure(action, path, done.returncode, done.stderr)
        return done

    def read(self, path: Path, *, kept: bool = True) -> VllmManifest:
        """The manifest of vLLM's artifact at `path` as vLLM reads it (which checks its
        permissions and schema); cached while manifest.json is unchanged, since each call
        costs vLLM's import time. With `kept`, vLLM's reading at the snapshot's creation
        (INSPECTED) stands in for it: the store's checksums, checked before any restore, say
        that the artifact and that reading are the bytes sealed together, and a vLLM of
        another version makes the snapshot stale first. `kept=False`: vLLM reads it now
        (`pitstop vllm-snapshot inspect`, which asks for vLLM's own word)."""
        key = _stat_key(path / "manifest.json")
        hit = self._inspected.get(path)
        if kept and hit is not None and hit[0] == key:
            return hit[1]
        manifest = _kept_reading(path) if kept else None
        if manifest is None:
            manifest = VllmManifest.from_inspect(path, self._inspect(path))
        self._inspected[path] = (key, manifest)
        return manifest

    def _inspect(self, path: Path) -> dict[str, Any]:
        """`vllm snapshot inspect PATH`: vLLM's manifest as JSON."""
        done = self._call("inspect", path, INSPECT_TIMEOUT_S)
        try:
            data = json.loads(done.stdout[done.stdout.index("{"):])
        except ValueError as e:
            raise VllmSnapshotError(f"corrupt: `vllm snapshot inspect {path}` printed no JSON "
                                    f"manifest: {done.stdout[-200:]!r}", RefusalCode.CORRUPT) from e
        if not isinstance(data, dict):
            raise VllmSnapshotError(f"corrupt: `vllm snapshot inspect {path}` printed "
                                    f"{type(data).__name__}, not a manifest", RefusalCode.CORRUPT)
        return data

    # --- the CheckpointBackend interface ---------------------------------------------------
    def create(self, request: CreateRequest, staging: Path) -> Image:
        """Run `vllm snapshot create` into `staging`/vllm: vLLM starts an engine of its own
        (`request.pid` is not used), dumps it and publishes its artifact."""
        done = self._call("create", self.artifact(staging), self.create_limit_s)
        data = self._inspect(self.artifact(staging))
        m = VllmManifest.from_inspect(self.artifact(staging), data)
        # Sealed with the artifact by the store (the image's files are every file here).
        (staging / INSPECTED).write_text(json.dumps(data))
        return Image(
            process=ProcessTree(root_pid=m.root_pid, pids=m.pids or (m.root_pid,),
                                cuda_pids=m.cuda_pids),
            canary=Canary(prompt=ORACLE_PROMPT, max_tokens=1, text=m.canary_text,
                          token_ids=m.canary_token_ids),
            timings={"vllm_create": done.duration_s}, scratch=SCRATCH)

    def inspect(self, manifest: Manifest, image: Path) -> Skipped | None:
        """vLLM's own reading of the artifact, and whether it was taken with this
        configuration (model, revision, engine argv); vLLM checks its identity again,
        strictly, at restore."""
        try:
            m = self.read(self.artifact(image))
        except VllmSnapshotError as e:
            return Skipped(manifest.id, Refusal(e.code, str(e)))
        reason = self._mismatch(m)
        return None if reason is None else Skipped(manifest.id, Refusal(RefusalCode.STALE, reason))

    def _mismatch(self, m: VllmManifest) -> str | None:
        if (m.model, m.model_revision) != (self.model, self.revision):
            return (f"it holds {m.model}@{m.model_revision[:12]}, vllm.snapshot asks for "
                    f"{self.model}@{self.revision[:12]}")
        want = self.expected_argv()
        if m.engine_argv != want:
            # Positions shift when a flag is added; naming the words on either side reads best.
            old = [a for a in m.engine_argv if a not in want]
            new = [a for a in want if a not in m.engine_argv]
            parts = ([f"only the snapshot has {old}"] if old else []) + \
                ([f"only the configuration has {new}"] if new else [])
            said = " and ".join(parts) or "same words, another order"
            return (f"engine_args differ: {said} (engine.args or "
                    "engine.served_model_name changed)")
        return None

    def restore(self, manifest: Manifest, image: Path, *,
                gpu_uuid: str | None = None) -> RestoredProcess:
        """Restore and verify (vLLM's own canary); `gpu_uuid` is unused (it remaps nothing).
        The restored tree is detached from `vllm snapshot restore` and re-parented to the
        nearest subreaper: the agent."""
        done = self._call("restore", self.artifact(image), self.restore_limit_s)
        return RestoredProcess(pid=manifest.process.root_pid, snapshot_id=manifest.id,
                               outputs={}, log_path=self.artifact(image) / "child.log",
                               timings={"vllm_restore": done.duration_s})


def _kept_reading(artifact: Path) -> VllmManifest | None:
    """vLLM's reading of `artifact` kept at its snapshot's creation, or None: a snapshot from
    before it was kept, or one that does not parse (its checksum will not match either)."""
    try:
        data = json.loads((artifact.parent / INSPECTED).read_text())
        return VllmManifest.from_inspect(artifact, data) if isinstance(data, dict) else None
    except (OSError, ValueError, VllmSnapshotError):
        return None


def _stat_key(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return (None,)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def choose_backend(config: Config, features: Callable[[], VllmFeatures],
                   has_gpu: Callable[[], bool]) -> tuple[str, str]:
    """("vllm" or "pitstop", why) for snapshots.backend; `auto` resolves on this host.

    Example::

        backend, why = choose_backend(cfg, lambda: read_features(py), lambda: gpu_present())
    """
    chosen = config.snapshots.backend
    if chosen == "pitstop":
        return "pitstop", "snapshots.backend: pitstop"
    if chosen == "vllm":
        return "vllm", "snapshots.backend: vllm"
    if config.engine.kind != "vllm":
        return "pitstop", f"auto: engine.kind is {config.engine.kind}"
    if config.vllm.snapshot.model is None or config.vllm.snapshot.revision is None:
        return "pitstop", "auto: vllm.snapshot.model/revision are not set"
    f = features()
    if not f.snapshot:
        return "pitstop", f"auto: the installed vLLM ({f.describe()}) has no `vllm snapshot`"
    if not f.cuda_build:
        return "pitstop", f"auto: the installed vLLM ({f.describe()}) is not a CUDA build"
    if not has_gpu():
        return "pitstop", "auto: no NVIDIA GPU on this host"
    return "vllm", f"auto: {f.describe()} has `vllm snapshot` and the host has a GPU"
