"""Exec a command that dies with its parent: PR_SET_PDEATHSIG(SIGKILL), then execve.

Run as a script (`python -I -S deathsig.py PARENT_PID -- ARGV...`), never imported by the
child: it must not depend on the agent's package or site-packages. The signal survives the
execve (prctl(2): it is cleared only for set-user-ID or capability-gaining programs), so the
engine it becomes is SIGKILLed when the thread that forked it exits. Arming it in a tiny
program between fork and exec, not in `subprocess`'s `preexec_fn`, keeps Python code out of
a forked copy of the multi-threaded agent, where `preexec_fn` can deadlock.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# What `sh` says for a command it cannot run; the supervisor reads it as a failed start.
EXIT_CANNOT_RUN = 127


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        print(f"usage: {argv[0]} PARENT_PID -- COMMAND [ARG...]", file=sys.stderr)
        return EXIT_CANNOT_RUN
    parent, command = int(argv[1]), argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"pitstop: prctl(PR_SET_PDEATHSIG): {os.strerror(err)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    # The parent may have died between fork and prctl: then nothing would ever fire, and the
    # engine would start orphaned. Re-parenting changes getppid(), so this closes the window.
    if os.getppid() != parent:
        print(f"pitstop: the agent (PID {parent}) died before the engine started; not starting",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"pitstop: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
    return EXIT_CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main(sys.argv))
