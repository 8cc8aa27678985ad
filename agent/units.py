"""Install the systemd units, sysctl and tmpfiles snippets with this installation's paths."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from agent.config import PathsConfig, load_config
from agent.errors import UnitsError
from agent.node import ENGINES_DIR, Engine

AGENT_UNIT = "pitstop-agent.service"
# One agent per engine of a node of several: rendered from AGENT_UNIT's text.
AGENT_TEMPLATE = "pitstop-agent@.service"
HOLDER_TEMPLATE = "pitstop-holder@.service"
HOLDERS_TARGET = "pitstop-holders.target"
PRELOAD_TEMPLATE = "pitstop-vllm-preload@.service"
# The files shipped in agent/units (= units/), each installed under its own name.
UNIT_FILES = (AGENT_UNIT, HOLDER_TEMPLATE, HOLDERS_TARGET, PRELOAD_TEMPLATE)
SYSCTL_FILE = "99-pitstop.conf"
HOLDER_BACKENDS = ("cuda", "cpu")
TMPFILES_FILE = "pitstop.conf"

UNIT_DIR = Path("etc/systemd/system")
SYSCTL_DIR = Path("etc/sysctl.d")
TMPFILES_DIR = Path("etc/tmpfiles.d")

_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
# A GPU UUID as nvidia-smi prints it (GPU-8b3c...), or any plain instance name for tests.
_INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class UnitPaths:
    """What the @NAME@ placeholders of the shipped files stand for on this host."""

    pitstop: Path
    config: Path
    state_dir: Path
    snapshot_dir: Path
    run_dir: Path
    holder_backend: str = "cuda"
    # The venv that installs the units is the one they run (or a wrapper execs).
    python: Path = field(default_factory=lambda: Path(sys.executable))
    engines_dir: Path = ENGINES_DIR
    # The node's engines, whose directories the tmpfiles snippet makes too.
    engines: tuple[Engine, ...] = ()

    def values(self) -> dict[str, str]:
        if self.holder_backend not in HOLDER_BACKENDS:
            raise UnitsError(f"holder backend {self.holder_backend!r}: use one of "
                             f"{', '.join(HOLDER_BACKENDS)}")
        return {
            "PITSTOP": systemd_quote(self.pitstop),
            "CONFIG": systemd_quote(self.config),
            "AGENT_OF": "node agent",
            "RUN_ARGS": f"--config {systemd_quote(self.config)}",
            "SYSLOG_IDENTIFIER": "pitstop",
            "HOLDER_BACKEND": self.holder_backend,
            "STATE_DIR": tmpfiles_path(self.state_dir),
            "SNAPSHOT_DIR": tmpfiles_path(self.snapshot_dir),
            "RUN_DIR": tmpfiles_path(self.run_dir),
            "ENGINE_DIRS": self._engine_dirs(),
            "PRIVATE_TMP": "no" if self.under_tmp() else "yes",
        }

    def template_values(self) -> dict[str, str]:
        """AGENT_UNIT's text as the template: the instance names the engine and its file."""
        return {**self.values(), "AGENT_OF": "agent of engine %i",
                "RUN_ARGS": f"--engine %i --engines-dir {systemd_quote(self.engines_dir)}",
                "SYSLOG_IDENTIFIER": "pitstop@%i"}

    def _engine_dirs(self) -> str:
        seen = {self.state_dir, self.snapshot_dir, self.run_dir}
        lines = []
        for e in self.engines:
            p = e.config.paths
            for kind, path in (("d", p.state_dir), ("d", p.snapshots), ("D", p.run)):
                # tmpfiles.d warns of a path listed twice; the check refuses two engines on one.
                if path not in seen:
                    seen.add(path)
                    lines.append(f"{kind} {tmpfiles_path(path)} 0700 root root -")
        return "\n".join(lines) or "# (none)"

    def under_tmp(self) -> bool:
        """Whether the holder needs the host's /tmp: PrivateTmp would hide an install there."""
        tmps = (Path("/tmp"), Path("/var/tmp"))
        return any(t == p or t in p.parents
                   for p in (self.pitstop, self.config, self.python) for t in tmps)


def systemd_quote(path: Path) -> str:
    """A path as one word of an Exec= line: % and $ are escaped, spaces quoted."""
    if not path.is_absolute():
        raise UnitsError(f"{path}: systemd needs an absolute path here; pass an absolute one")
    s = str(path).replace("%", "%%").replace("$", "$$")
    if any(c in s for c in " \t\"'\\\n"):
        if "\n" in s or '"' in s:
            raise UnitsError(f"{path!r}: a path with a newline or double quote cannot be put "
                             "in a unit file; install to another path")
        s = '"' + s.replace("\\", "\\\\") + '"'
    return s


def tmpfiles_path(path: Path) -> str:
    if not path.is_absolute() or any(c.isspace() for c in str(path)):
        raise UnitsError(f"paths: {path} must be absolute and without spaces for tmpfiles.d(5); "
                         "change it in the configuration")
    return str(path).replace("%", "%%")


def shipped(name: str) -> str:
    """The text of one shipped file (package data `agent/units`, the repo's `units/`)."""
    try:
        return resources.files("agent").joinpath("units", name).read_text()
    except OSError as e:
        raise UnitsError(
            f"{name}: not found in the installed package ({e}); reinstall pitstop") from e


def render(text: str, values: dict[str, str], name: str) -> str:
    """Replace every @NAME@; a placeholder without a value is a packaging bug, so it raises."""

    def sub(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise UnitsError(f"{name}: unknown placeholder {m.group(0)}") from None

    return _PLACEHOLDER.sub(sub, text)


def default_pitstop_bin() -> Path:
    """The `pitstop` entry point beside the running interpreter (a venv's bin/)."""
    candidate = Path(sys.executable).parent / "pitstop"
    if not os.access(candidate, os.X_OK):
        raise UnitsError(f"no pitstop command at {candidate}; pass --pitstop-bin PATH")
    return candidate.absolute()


def paths_for(pitstop: Path, config_path: Path, holder_backend: str = "cuda",
              engines_dir: Path = ENGINES_DIR, engines: tuple[Engine, ...] = ()) -> UnitPaths:
    """Directories come from the configuration when it exists, else from its defaults."""
    paths = load_config(config_path).paths if config_path.exists() else PathsConfig()
    return UnitPaths(pitstop=pitstop, config=config_path, state_dir=paths.state_dir,
                     snapshot_dir=paths.snapshots, run_dir=paths.run,
                     holder_backend=holder_backend, engines_dir=engines_dir, engines=engines)


def install(prefix: Path, paths: UnitPaths) -> tuple[Path, ...]:
    """Write the rendered files under `prefix` (0644, atomically); return what was written."""
    values = paths.values()
    targets = [(name, UNIT_DIR / name, values) for name in UNIT_FILES]
    targets.insert(1, (AGENT_UNIT, UNIT_DIR / AGENT_TEMPLATE, paths.template_values()))
    targets += [(SYSCTL_FILE, SYSCTL_DIR / SYSCTL_FILE, values),
                (TMPFILES_FILE, TMPFILES_DIR / TMPFILES_FILE, values)]
    written = []
    for name, rel, vals in targets:
        dest = prefix / rel
        _write(dest, render(shipped(name), vals, name))
        written.append(dest)
    return tuple(written)


def _write(dest: Path, text: str) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # Units are read by systemd and by people; the umask must not make them private.
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except OSError as e:
        raise UnitsError(f"{dest}: cannot write: {e.strerror}; run as root or pass --prefix") from e


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UnitsError(f"{' '.join(argv)}: {e}") from e


def _check(r: subprocess.CompletedProcess[str], what: str) -> None:
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip()[-2000:]
        raise UnitsError(f"{' '.join(r.args)} exited with {r.returncode} ({what}): {tail}")


def _check_instances(holders: Sequence[str], preloads: Sequence[str]) -> None:
    for h in holders:
        if not _INSTANCE.match(h):
            raise UnitsError(f"--holder {h!r}: not a GPU UUID (expected e.g. GPU-8b3c2f1e-...)")
    for g in preloads:
        if not _INSTANCE.match(g):
            raise UnitsError(f"--vllm-preload {g!r}: not a GPU index or UUID (e.g. 0 or "
                             "GPU-8b3c2f1e-...)")


def activate(prefix: Path, enable: bool, holders: Sequence[str],
             run: Runner = _run, preloads: Sequence[str] = (),
             engines: Sequence[str] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Make the installed files take effect; return (commands run, warnings).

    `preloads`: GPUs (index or UUID) whose `vllm preload` daemon is enabled; each becomes a
    want of the agent (the template's WantedBy=pitstop-agent.service).
    `engines`: the node's engines; when there are any, their agents (pitstop-agent@NAME) are
    enabled instead of the one-engine pitstop-agent.service.

    On the live system (prefix /): daemon-reload, create the tmpfiles directories, apply the
    sysctl. Under another prefix only `systemctl --root` enabling is possible, which is offline.
    """
    _check_instances(holders, preloads)
    live = prefix.resolve() == Path("/")
    done: list[str] = []
    warnings: list[str] = []

    def go(argv: list[str], what: str, fatal: bool = True) -> None:
        r = run(argv)
        done.append(" ".join(argv))
        if fatal:
            _check(r, what)
        elif r.returncode != 0:
            warnings.append(f"{' '.join(argv)} failed ({what}): {(r.stderr or r.stdout).strip()}")

    if live:
        go(["systemctl", "daemon-reload"], "systemd must see the new unit files")
        go(["systemd-tmpfiles", "--create", str(prefix / TMPFILES_DIR / TMPFILES_FILE)],
           "the state, snapshot and run directories")
        # In a container /proc/sys is read-only; the file still applies at the host's next boot.
        go(["sysctl", "-p", str(prefix / SYSCTL_DIR / SYSCTL_FILE)],
           "kernel.io_uring_disabled=2; until it is set CRIU cannot dump an engine using io_uring",
           fatal=False)
    if enable:
        root = [] if live else [f"--root={prefix}"]
        agents = [f"pitstop-agent@{e}.service" for e in engines] or [AGENT_UNIT]
        units = [*agents, HOLDERS_TARGET] + [f"pitstop-holder@{h}.service" for h in holders]
        units += [f"pitstop-vllm-preload@{g}.service" for g in preloads]
        go(["systemctl", *root, "enable", *units], "enable the units")
    if engines and run(["systemctl", *([] if live else [f"--root={prefix}"]), "is-enabled",
                        AGENT_UNIT]).stdout.strip() == "enabled":
        warnings.append(f"{AGENT_UNIT} (the agent of a node's one engine) is enabled beside "
                        f"the engines' agents; if it serves one of them, `systemctl disable "
                        f"--now {AGENT_UNIT}` (docs/fleet.md, several engines on a node)")
    return tuple(done), tuple(warnings)
