"""The one subprocess runner: timeouts, log tails on failure, a typed result."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from agent.errors import CommandError
from agent.proc import disown, own, spawn_lock, wait_exits

TAIL_LINES = 20


@dataclass(frozen=True)
class CommandResult:
    """What one finished command did.

    Example::

        r = run(["criu", "--version"], timeout_s=10)
        r.returncode, r.stdout, r.duration_s
    """

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Runner(Protocol):
    """The signature of `run`, so that callers can take another runner (a fake in unit tests)."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        pass_fds: Sequence[int] = (),
        log_path: Path | None = None,
        inherit_env: bool = True,
    ) -> CommandResult: ...


def tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of `text`, for error messages."""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def read_tail(path: Path | None, lines: int = TAIL_LINES) -> str:
    """The last lines of a log file, or "" when it cannot be read (it is only for a message)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return tail(f.read().decode(errors="replace"), lines)
    except OSError:
        return ""


def run(
    argv: Sequence[str],
    *,
    timeout_s: float,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    pass_fds: Sequence[int] = (),
    log_path: Path | None = None,
    inherit_env: bool = True,
) -> CommandResult:
    """Run `argv` to completion with stdin from /dev/null, capturing stdout and stderr.
    `env` is added to this process's environment, or, with `inherit_env=False`, is the
    whole environment (an engine's interpreter probed with the engine's own).

    Raises CommandError when it cannot start, runs past `timeout_s` (it is killed),
    or, with `check`, exits non-zero; the message holds the tails of stderr and of
    `log_path` (the command's own log file, such as CRIU's `-o` log).
    """
    args = [str(a) for a in argv]
    full_env = None
    if env is not None:
        full_env = {**os.environ, **env} if inherit_env else dict(env)
    start = time.monotonic()
    # Output goes to unlinked files, not pipes: a child the command leaves behind (a CRIU
    # helper whose parent was killed mid-dump, seen in the soak) keeps a pipe open for as
    # long as it lives, and reading to EOF would wait for it. A file is read at exit.
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        try:
            with spawn_lock():
                p = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    env=full_env,
                    cwd=cwd,
                    pass_fds=tuple(pass_fds),
                )
                own(p.pid)
        except OSError as e:
            raise CommandError(
                f"cannot start {args[0]}: {e.strerror}; check that it is installed"
            ) from e
        try:
            # Woken by the kernel through a pidfd when it exits: Popen.wait(timeout) polls
            # with sleeps growing to 50 ms, and a CRIU restore of half a second was seen to
            # end up to 50 ms late.
            wait_exits((p.pid,), timeout_s)
            if p.poll() is None:
                p.kill()
                p.wait()
                raise CommandError(
                    _describe(args, f"timed out after {timeout_s:g} s and was killed",
                              _read(err_f), log_path)
                )
        finally:
            disown(p.pid)
        out, err = _read(out_f), _read(err_f)
    result = CommandResult(tuple(args), p.returncode, out, err, time.monotonic() - start)
    if check and not result.ok:
        raise CommandError(_describe(args, f"exited with status {p.returncode}", err, log_path))
    return result


def _read(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _describe(args: list[str], what: str, stderr: str, log_path: Path | None) -> str:
    msg = f"{' '.join(args)} {what}"
    if stderr.strip():
        msg += f"\n--- stderr (last lines) ---\n{tail(stderr)}"
    log = read_tail(log_path)
    if log:
        msg += f"\n--- {log_path} (last lines) ---\n{log}"
    return msg
