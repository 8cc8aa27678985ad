"""Find the CRIU binary Pitstop uses and check that it is new enough (>= 4.1)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.commands import Runner, run
from agent.errors import CommandError, SnapshotError

MIN_VERSION = (4, 1)
ENV_VAR = "PITSTOP_CRIU"
# `make criu` writes this wrapper in a source checkout (scripts/install-criu.sh).
REPO_WRAPPER = Path(__file__).resolve().parents[2] / ".cache" / "criu" / "bin" / "criu"
FIX = "run `make criu`, or install CRIU >= 4.1 and set PITSTOP_CRIU or snapshots.criu"


@dataclass(frozen=True)
class CriuBinary:
    """A CRIU that runs, with its version and where it was found.

    Example::

        criu = locate()
        criu.path, criu.version, criu.source  # (PosixPath(...), '4.1.1', 'make criu')
    """

    path: Path
    version: str
    source: str


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"^Version:\s*(\d+(?:\.\d+)*)", text, re.M)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def probe(path: Path, source: str, runner: Runner = run) -> CriuBinary:
    """Run `path --version`; raise SnapshotError unless it is CRIU >= 4.1."""
    try:
        r = runner([str(path), "--version"], timeout_s=30)
    except CommandError as e:
        raise SnapshotError(f"CRIU at {path} (from {source}) does not run: {e}; {FIX}") from e
    v = parse_version(r.stdout)
    if v is None:
        raise SnapshotError(f"{path} (from {source}) printed no CRIU version; {FIX}")
    if v < MIN_VERSION:
        raise SnapshotError(
            f"CRIU at {path} (from {source}) is {'.'.join(map(str, v))}; Pitstop needs >= "
            f"{'.'.join(map(str, MIN_VERSION))} (older ones fail on kernels >= 6.13); {FIX}"
        )
    return CriuBinary(path, ".".join(map(str, v)), source)


def locate(
    configured: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    repo_wrapper: Path = REPO_WRAPPER,
    sbin_dirs: tuple[str, ...] = ("/usr/sbin", "/usr/local/sbin"),
    runner: Runner = run,
) -> CriuBinary:
    """The CRIU to use: the config key, then $PITSTOP_CRIU, then `make criu`'s wrapper,
    then `criu` on PATH. A path named explicitly (config, env) must work: it is never
    skipped for another one."""
    env = os.environ if environ is None else environ
    if configured is not None:
        return probe(Path(configured), "config snapshots.criu", runner)
    if env.get(ENV_VAR):
        return probe(Path(env[ENV_VAR]), f"${ENV_VAR}", runner)
    if os.access(repo_wrapper, os.X_OK):
        return probe(repo_wrapper, "make criu", runner)
    # A distribution's criu lives in /usr/sbin, often not on a non-root PATH.
    found = shutil.which("criu", path=os.pathsep.join((env.get("PATH", os.defpath), *sbin_dirs)))
    if found:
        return probe(Path(found), "PATH", runner)
    raise SnapshotError(f"no CRIU found; {FIX}")
