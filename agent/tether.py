"""Kill what is left of the engine the moment the agent dies: a helper outside the engine tree.

`python -m agent.tether` is started once by the agent, with stdin the read end of a pipe
that only the agent holds open. For each engine that starts (or is restored) the agent
writes one line, `PID START_TIME PGID SESSION`, and an empty line once it stopped that engine
itself. When the agent's process ends, however it ends, the kernel closes the pipe: the
helper reads end-of-file, SIGKILLs what is left of the last engine named, and exits.

The engine's root already dies by its own death signal (agent/deathsig.py); this reaches the
rest of its process group, which no signal of the kernel's reaches: vLLM's engine core and
its helpers, children of an API server that just died. It lives in a session of its own, so a
Ctrl-C at the agent's terminal (which the agent answers by stopping the engine itself) does
not end it first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from agent import proc


def parse(line: str) -> tuple[int, int, int, int] | None:
    """The engine a line names, or None for an empty line (no engine to kill)."""
    fields = line.split()
    if not fields:
        return None
    if len(fields) != 4 or not all(f.isdigit() for f in fields):
        raise ValueError(f"expected `PID START_TIME PGID SESSION`, got {line!r}")
    pid, start_time, pgid, session = map(int, fields)
    return pid, start_time, pgid, session


def main() -> int:
    # The agent's own signals are not the helper's business: only the pipe's end is.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    engine = None
    for raw in sys.stdin:
        try:
            engine = parse(raw)
        except ValueError as e:
            print(f"pitstop tether: ignoring a line from the agent: {e}", file=sys.stderr)
    if engine is None:
        return 0
    remains = proc.engine_remains(*engine)
    for pid in remains:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if remains:
        print(f"pitstop tether: the agent died; killed what was left of its engine: PIDs "
              f"{remains} (process group {engine[2]})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
