"""Exec a command that dies with its parent: PR_SET_PDEATHSIG(SIGKILL), then execve.

Run as a script (`python -I -S deathsig.py PARENT_PID [--root] -- ARGV...`), never imported
by the child: it must not depend on the agent's package or site-packages. The signal survives
the execve (prctl(2): it is cleared only for set-user-ID or capability-gaining programs), so
the engine it becomes is SIGKILLed when the thread that forked it exits. Arming it in a tiny
program between fork and exec, not in `subprocess`'s `preexec_fn`, keeps Python code out of
a forked copy of the multi-threaded agent, where `preexec_fn` can deadlock.

With `--root` it does not become the engine: it stays the root of the engine's process tree,
a process of a few MB that forks the engine (armed to die with it), hands on the signals a
supervisor sends, and ends as the engine ended. CRIU restores a tree's root only after every
other process of the tree is restored whole, its memory included (criu/cr-restore.c: the root
waits for the other tasks before it switches to its restorer), so an engine of several large
processes (vLLM's API server and engine core) comes back faster under a small root: their
memory is read in parallel, not the API server's after the engine core's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# What `sh` says for a command it cannot run; the supervisor reads it as a failed start.
EXIT_CANNOT_RUN = 127
# What a supervisor or an operator sends the engine, handed on by the root.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def _die_with(parent: int, libc: ctypes.CDLL, who: str) -> bool:
    """Arm PR_SET_PDEATHSIG(SIGKILL); False (said on stderr) if `parent` is already gone."""
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"pitstop: prctl(PR_SET_PDEATHSIG): {os.strerror(err)}", file=sys.stderr)
        return False
    # The parent may have died between fork and prctl: then nothing would ever fire, and the
    # engine would start orphaned. Re-parenting changes getppid(), so this closes the window.
    if os.getppid() != parent:
        print(f"pitstop: {who} (PID {parent}) died before the engine started; not starting",
              file=sys.stderr)
        return False
    return True


def _exec(command: list[str]) -> int:
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"pitstop: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def _root(command: list[str], libc: ctypes.CDLL) -> int:
    """Fork the engine, hand it the forwarded signals, end as it ended."""
    root = os.getpid()
    child = os.fork()
    if child == 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        if not _die_with(root, libc, "the engine's root"):
            os._exit(EXIT_CANNOT_RUN)
        os._exit(_exec(command))

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # gone: its status is on its way
            os.kill(child, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _, status = os.waitpid(child, 0)  # PEP 475: retried after each forwarded signal
    if os.WIFSIGNALED(status):
        # Die of the same signal, so the supervisor reads the engine's end, not ours.
        sig = os.WTERMSIG(status)
        if sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(root, sig)
        return 128 + sig  # a signal that does not kill (none of the engine's did)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    root = len(argv) > 2 and argv[2] == "--root"
    rest = argv[3 if root else 2:]
    if len(rest) < 2 or rest[0] != "--" or not argv[1].isdigit():
        print(f"usage: {argv[0]} PARENT_PID [--root] -- COMMAND [ARG...]", file=sys.stderr)
        return EXIT_CANNOT_RUN
    parent, command = int(argv[1]), rest[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if not _die_with(parent, libc, "the agent"):
        return EXIT_CANNOT_RUN
    return _root(command, libc) if root else _exec(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
