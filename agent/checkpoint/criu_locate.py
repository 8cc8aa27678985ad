"""Find the CRIU binary Pitstop uses and check that it is new enough (MIN_VERSION)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.commands import Runner, run
from agent.errors import CommandError, SnapshotError

# The one minimum (scripts/install-criu.sh and the criu role mirror it; a test compares).
# CRIU 4.1 fails any dump of a process holding a TCP socket on Linux >= 6.16:
# "sockets: Can't get 1:16 opt: Operation not supported" (CRIU issue 2705; fixed in 4.2,
# "criu/sockets: Restrict SO_PASSCRED and SO_PASSSEC to supported families"). vLLM's
# workers always hold one. Older ones fail on >= 6.13 ("vdso: Unexpected rt vDSO area bounds").
MIN_VERSION = (4, 2)
MIN_TEXT = ".".join(map(str, MIN_VERSION))
ENV_VAR = "PITSTOP_CRIU"
# `make criu` writes this wrapper in a source checkout (scripts/install-criu.sh).
REPO_WRAPPER = Path(__file__).resolve().parents[2] / ".cache" / "criu" / "bin" / "criu"
FIX = f"run `make criu`, or install CRIU >= {MIN_TEXT} and set PITSTOP_CRIU or snapshots.criu"


@dataclass(frozen=True)
class CriuBinary:
    """A CRIU that runs, with its version and where it was found.

    Example::

        criu = locate()
        criu.path, criu.version, criu.source  # (PosixPath(...), '4.2.1', 'make criu')
    """

    path: Path
    version: str
    source: str


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"^Version:\s*(\d+(?:\.\d+)*)", text, re.M)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def probe(path: Path, source: str, runner: Runner = run) -> CriuBinary:
    """Run `path --version`; raise SnapshotError unless it is CRIU >= MIN_VERSION."""
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
            f"{MIN_TEXT}: {too_old(v)}; {FIX}"
        )
    return CriuBinary(path, ".".join(map(str, v)), source)


def too_old(version: tuple[int, ...]) -> str:
    """What goes wrong with a CRIU older than MIN_VERSION on the kernels of 2026."""
    if version < (4, 0):
        return "it fails on kernels >= 6.13 (vdso: Unexpected rt vDSO area bounds)"
    return ("on Linux >= 6.16 it fails to dump any process holding a TCP socket, as vLLM's "
            "workers do (sockets: Can't get 1:16 opt; CRIU issue 2705, fixed in 4.2)")


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
