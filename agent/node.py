"""The engines of one node: a configuration file and an agent each, and what no two may share."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from agent import engineargs
from agent.config import Config, load_config
from agent.errors import ConfigError

# pitstop-agent@<name>.service reads <ENGINES_DIR>/<name>.yaml.
ENGINES_DIR = Path("/etc/pitstop/engines")
# A systemd instance name, a file name and a Prometheus label value all at once: nothing
# that systemd would escape (/, @, spaces) and nothing a shell glob or a path would mangle.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# vLLM's own default share of each GPU it uses (its --gpu-memory-utilization).
VLLM_DEFAULT_GPU_SHARE = 0.9
GPU_SHARE_FLAG = "--gpu-memory-utilization"
# Hosts a listener on which takes the port on every address.
_ANY = {"", "0.0.0.0", "::", "[::]", "*"}


def check_name(name: str) -> str:
    """`name` when it can name an engine; else a ConfigError saying what can."""
    if not _NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"engine name {name!r}: use 1 to 64 letters, digits, '_', '.' or '-', "
                          "starting with a letter or digit (it names a systemd instance, a file "
                          "and a metric label)")
    return name


def engine_path(name: str, engines_dir: Path = ENGINES_DIR) -> Path:
    return engines_dir / f"{check_name(name)}.yaml"


def engine_names(engines_dir: Path = ENGINES_DIR) -> list[str]:
    """The engines configured in `engines_dir`, sorted; none when it does not exist."""
    try:
        files = sorted(p for p in engines_dir.iterdir() if p.suffix == ".yaml")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"{engines_dir}: cannot list the engines: {e.strerror}") from None
    for f in files:
        try:
            check_name(f.stem)
        except ConfigError as e:
            raise ConfigError(f"{f}: {e}; rename the file") from None
    return [f.stem for f in files]


@dataclass(frozen=True)
class Engine:
    """One engine of the node: its name, its file and what the file says."""

    name: str
    path: Path
    config: Config


def load_engine(path: Path, name: str | None = None) -> Engine:
    """The engine in `path`, named `name` (checked), or by the file's own name (a file
    checked by itself may be any temporary file: its name names nothing)."""
    return Engine(check_name(name) if name is not None else path.stem, path, load_config(path))


def load_engines(engines_dir: Path = ENGINES_DIR) -> list[Engine]:
    return [load_engine(engine_path(n, engines_dir)) for n in engine_names(engines_dir)]


@dataclass(frozen=True)
class Conflict:
    """Something two (or more) engines of one node claim that only one can have."""

    what: str
    files: tuple[Path, ...]
    fix: str

    def __str__(self) -> str:
        return f"{' and '.join(map(str, self.files))} {self.what}; {self.fix}"


def conflicts(engines: Sequence[Engine]) -> list[Conflict]:
    """Every clash between the engines: ports, directories, GPU memory beyond a GPU's size."""
    found: list[Conflict] = []
    for a, b in combinations(engines, 2):
        found += _port_clashes(a, b) + _dir_clashes(a, b)
    return found + _gpu_clashes(engines)


def _ports(cfg: Config) -> list[tuple[str, str, int]]:
    """(key, host, port) of every TCP listener the engine's agent opens; port 0 never clashes."""
    out = []
    if cfg.front.enabled:
        out.append(("front.port", cfg.front.host, cfg.front.port))
    if cfg.metrics.enabled:
        out.append(("metrics.port", cfg.metrics.host, cfg.metrics.port))
    if cfg.engine.kind == "vllm" and cfg.vllm.snapshot.model is not None:
        # A restored vLLM snapshot listens there (the agent relays its socket to it).
        out.append(("vllm.snapshot.port", "127.0.0.1", cfg.vllm.snapshot.port))
    return [p for p in out if p[2] != 0]


def _port_clashes(a: Engine, b: Engine) -> list[Conflict]:
    found = []
    for ka, ha, pa in _ports(a.config):
        for kb, hb, pb in _ports(b.config):
            if pa == pb and (ha == hb or ha in _ANY or hb in _ANY):
                found.append(Conflict(
                    f"both listen on port {pa} ({ka} of {a.name} on {ha}, {kb} of {b.name} on "
                    f"{hb})", (a.path, b.path),
                    "give each engine its own front and metrics ports"))
    return found


def _dirs(cfg: Config) -> dict[str, Path]:
    p = cfg.paths
    return {"paths.state_dir": p.state_dir, "paths.snapshot_dir": p.snapshots,
            "paths.run_dir": p.run, "engine.socket": cfg.engine_socket}


def _dir_clashes(a: Engine, b: Engine) -> list[Conflict]:
    found = []
    for ka, da in _dirs(a.config).items():
        for kb, db in _dirs(b.config).items():
            if os.path.normpath(da) == os.path.normpath(db):
                found.append(Conflict(
                    f"both use {da} ({ka} of {a.name}, {kb} of {b.name})", (a.path, b.path),
                    "give each engine its own paths.state_dir and paths.run_dir (e.g. "
                    "/var/lib/pitstop/engines/NAME and /run/pitstop/engines/NAME)"))
    return found


@dataclass(frozen=True)
class GpuClaim:
    """The GPUs an engine uses (as CUDA_VISIBLE_DEVICES names them) and its share of each."""

    gpus: tuple[str, ...]
    share: float


def gpu_claim(cfg: Config) -> GpuClaim | None:
    """What the engine takes of its GPUs, or None when it runs on CPU or declares no share.

    The share is `--gpu-memory-utilization` in engine.args (vLLM's flag, which the reference
    engine takes too); vLLM without it takes its default, 0.9. The GPUs are the first
    tensor-parallel-size of engine.env's CUDA_VISIBLE_DEVICES (all of them when unset).
    """
    if cfg.engine.device == "cpu":
        return None
    args = cfg.engine.args
    raw = engineargs.flag_value(args, [GPU_SHARE_FLAG])
    if raw is None:
        if cfg.engine.kind != "vllm":
            return None
        share = VLLM_DEFAULT_GPU_SHARE
    else:
        try:
            share = float(raw)
        except ValueError:
            raise ConfigError(f"engine.args: {GPU_SHARE_FLAG} {raw!r} is not a number (a "
                              "fraction of each GPU's memory, e.g. 0.45)") from None
    tp = engineargs.workers(args, engineargs.TENSOR_PARALLEL)
    visible = cfg.engine.env.get("CUDA_VISIBLE_DEVICES")
    names = [g.strip() for g in visible.split(",")] if visible is not None else []
    gpus = tuple(names[:tp]) if visible is not None else tuple(str(i) for i in range(tp))
    return GpuClaim(gpus, share)


def _gpu_clashes(engines: Sequence[Engine]) -> list[Conflict]:
    claims = [(e, c) for e in engines if (c := gpu_claim(e.config)) is not None and c.gpus]
    kinds = {(g.startswith("GPU-") or g.startswith("MIG-")) for _, c in claims for g in c.gpus}
    if len(kinds) > 1:
        return [Conflict(
            "name GPUs both by index and by UUID in engine.env.CUDA_VISIBLE_DEVICES, so their "
            "shares of each GPU cannot be added up", tuple(e.path for e, _ in claims),
            "name every GPU of the node the same way (all indices, or all UUIDs)")]
    found = []
    for gpu in sorted({g for _, c in claims for g in c.gpus}):
        on = [(e, c.share) for e, c in claims if gpu in c.gpus]
        total = sum(s for _, s in on)
        if len(on) > 1 and total > 1.0 + 1e-9:
            shares = ", ".join(f"{e.name} {s:g}" for e, s in on)
            found.append(Conflict(
                f"share GPU {gpu} and claim {total:.2f} of its memory ({GPU_SHARE_FLAG}: "
                f"{shares})", tuple(e.path for e, _ in on),
                f"lower their {GPU_SHARE_FLAG} so that they add up to at most 1"))
    return found


def engines_to_check(files: Sequence[Path], name: str | None,
                     engines_dir: Path = ENGINES_DIR) -> tuple[list[Engine], list[Engine]]:
    """What `pitstop check-config` checks: (the engines asked about, the node they are checked
    as). FILE...: those files, as one node. --engine NAME: FILE (or NAME's own file) as the
    new version of engine NAME, among the node's other engines. Neither: every engine.
    """
    if name is None:
        asked = [load_engine(f) for f in files] if files else load_engines(engines_dir)
        if not asked:
            raise ConfigError(f"no FILE given and no engine in {engines_dir} (<name>.yaml "
                              "files); pass a FILE, or --engines-dir DIR")
        return asked, asked
    if len(files) > 1:
        raise ConfigError("--engine NAME checks one FILE as that engine; give one FILE")
    this = load_engine(files[0] if files else engine_path(name, engines_dir), name)
    others = [load_engine(engine_path(n, engines_dir))
              for n in engine_names(engines_dir) if n != name]
    return [this], [this, *others]
