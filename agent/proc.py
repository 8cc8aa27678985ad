"""Process trees: the subreaper, reaping orphans, pidfds, killing a whole tree."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36

# Children whose exit status belongs to someone else (the engine watcher, commands.run):
# the reaper must leave those zombies alone or their owner would lose the status.
_owned: set[int] = set()
_lock = threading.Lock()


@contextlib.contextmanager
def spawn_lock() -> Iterator[None]:
    """Hold while starting a child and calling `own`, so the reaper cannot race the start."""
    with _lock:
        yield


def own(pid: int) -> None:
    _owned.add(pid)


def disown(pid: int) -> None:
    _owned.discard(pid)


def become_subreaper() -> None:
    """Orphans of the engine tree (and restored trees) re-parent to us, not to PID 1."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def _stat(proc: Path, pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of `pid`, or None when it is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _pids(proc: Path) -> Iterator[int]:
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            yield int(entry.name)


def children_of(parent: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """Direct children of `parent` and their states."""
    out = {}
    for pid in _pids(proc):
        st = _stat(proc, pid)
        if st and st[1] == parent:
            out[pid] = st[0]
    return out


def descendants(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every live descendant of `root`, parents before children."""
    parent_of: dict[int, int] = {}
    for pid in _pids(proc):
        st = _stat(proc, pid)
        if st:
            parent_of[pid] = st[1]
    order: list[int] = []
    frontier = [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        order.extend(kids)
        frontier.extend(kids)
    return order


def reap_orphans(proc: Path = Path("/proc")) -> list[tuple[int, int]]:
    """Reap every zombie child nobody owns; returns (pid, raw status) for each."""
    reaped = []
    if not _lock.acquire(blocking=False):
        return reaped  # a spawn is in progress; the next SIGCHLD or tick comes back
    try:
        for pid, state in children_of(os.getpid(), proc).items():
            if state != "Z" or pid in _owned:
                continue
            with contextlib.suppress(ChildProcessError):
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    reaped.append((got, status))
    finally:
        _lock.release()
    return reaped


def kill_tree(root: int, sig: int = signal.SIGKILL, proc: Path = Path("/proc")) -> None:
    """Signal `root` and every descendant; stopped processes are sent SIGCONT for SIGTERM."""
    targets = [root, *descendants(root, proc)]
    # Stop the root first so it cannot fork new children while we walk the tree.
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            if sig != signal.SIGKILL:
                os.kill(pid, signal.SIGCONT)


def pid_alive(pid: int, proc: Path = Path("/proc")) -> bool:
    st = _stat(proc, pid)
    return st is not None and st[0] != "Z"
