"""Process trees: the subreaper, reaping orphans, pidfds, killing a whole tree."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, TypeVar

PR_SET_CHILD_SUBREAPER = 36
DEATHSIG_WRAPPER = Path(__file__).with_name("deathsig.py")

T = TypeVar("T")

# PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, not the process
# (prctl(2)). Every engine is therefore forked by a thread that lives as long as the agent:
# the event loop's (a cold start) or this one (a CRIU restore, which takes seconds and must not
# block the loop). Its worker never exits before the interpreter does.
_parent_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pitstop-engine-parent")


async def in_parent_thread(fn: Callable[..., T], *args: object) -> T:
    """Run `fn`, which forks an engine (a CRIU restore), in the long-lived spawning thread."""
    return await asyncio.get_running_loop().run_in_executor(_parent_thread, fn, *args)


def with_deathsig(argv: list[str], root: bool = False) -> list[str]:
    """`argv` behind the exec wrapper that arms PR_SET_PDEATHSIG(SIGKILL) in the child;
    `root`: the wrapper stays, the small root of the engine's tree, and forks `argv`."""
    return [sys.executable, "-I", "-S", str(DEATHSIG_WRAPPER), str(os.getpid()),
            *(["--root"] if root else []), "--", *argv]


class Stat(NamedTuple):
    """The fields of /proc/PID/stat the agent uses (proc(5))."""

    state: str
    ppid: int
    pgid: int
    session: int
    # Clock ticks after boot: with the PID, it names one process for the life of the boot.
    start_time: int

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


def stat(pid: int, proc: Path = Path("/proc")) -> Stat | None:
    """What /proc/PID/stat says of `pid`, or None when it is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'. The field
    # after it is the 3rd of proc(5), so field N is at N - 3.
    fields = raw[raw.rindex(")") + 2 :].split()
    return Stat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def boot_id(proc: Path = Path("/proc")) -> str:
    """This boot's random id: PIDs and start times recorded in another boot mean nothing."""
    return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()


def _pids(proc: Path) -> Iterator[int]:
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            yield int(entry.name)


def children_of(parent: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """Direct children of `parent` and their states."""
    out = {}
    for pid in _pids(proc):
        st = stat(pid, proc)
        if st and st[1] == parent:
            out[pid] = st[0]
    return out


def _stats(proc: Path) -> dict[int, Stat]:
    """Every process's stat, in one pass over /proc."""
    return {pid: st for pid in _pids(proc) if (st := stat(pid, proc)) is not None}


def descendants(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every live descendant of `root`, parents before children."""
    return _descendants_in(root, {pid: st.ppid for pid, st in _stats(proc).items()})


def tree_and_group(root: int, proc: Path = Path("/proc")) -> list[int]:
    """`root`, its descendants, and the live members of the process group and session it
    leads (an engine leads its own): the rest of a tree whose root died first. One pass over
    /proc."""
    stats = _stats(proc)
    found = [root, *_descendants_in(root, {pid: st.ppid for pid, st in stats.items()})]
    known = set(found)
    return found + [pid for pid, st in stats.items()
                    if st.pgid == root and st.session == root and st.state != "Z"
                    and pid not in known]


def _descendants_in(root: int, parent_of: dict[int, int]) -> list[int]:
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


async def reap_forever(interval_s: float = 1.0) -> None:
    """Reap orphans every `interval_s` until cancelled: a SIGCHLD can be coalesced or come
    while a spawn holds the lock, and a restored tree's processes are ours to reap."""
    while True:
        for pid, status in reap_orphans():
            logging.getLogger("pitstop").debug("reaped orphan %d (status %d)", pid, status)
        await asyncio.sleep(interval_s)


def kill_tree(root: int, sig: int = signal.SIGKILL, proc: Path = Path("/proc")) -> None:
    """Signal `root` and every descendant; stopped processes are sent SIGCONT for SIGTERM."""
    targets = [root, *descendants(root, proc)]
    # Stop the root first so it cannot fork new children while we walk the tree.
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            if sig != signal.SIGKILL:
                os.kill(pid, signal.SIGCONT)


def ids_in_use(ids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """Which of `ids` the kernel still holds, each with one process that holds it.

    An ID stays allocated while a process or thread has it (a zombie too, until reaped) and
    while any process still names it as its process group or session: the kernel frees it
    with the last of them. CRIU restores every process and thread with its old ID (clone3
    with set_tid), so one held ID fails the restore ("Can't fork for N: File exists")."""
    want = set(ids)
    held: dict[int, int] = {}
    for pid in _pids(proc):
        st = stat(pid, proc)
        if st is None:
            continue
        for ident in (pid, st.pgid, st.session):
            if ident in want:
                held.setdefault(ident, pid)
        try:
            tids = os.listdir(proc / str(pid) / "task")
        except OSError:
            continue
        for tid in tids:
            if tid.isdigit() and int(tid) in want:
                held.setdefault(int(tid), pid)
    return held


def id_holders(ident: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process (a zombie too, until reaped) whose process group or session is
    `ident`: while one is left the kernel keeps that ID allocated (see `ids_in_use`)."""
    out = []
    for pid in _pids(proc):
        st = stat(pid, proc)
        if st is not None and ident in (st.pgid, st.session):
            out.append(pid)
    return out


def _exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited: its pidfd polls readable (pidfd_open(2))."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _pidfds(pids: Iterable[int]) -> list[int]:
    """A pidfd for each of `pids` still there (a zombie too); the caller closes them."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    return fds


async def exits(pids: Iterable[int], timeout: float) -> bool:
    """Wait until every one of `pids` still running has exited, told by the kernel through
    a pidfd each (no polling), or `timeout` passed; False when none of them was running
    (each gone, or exited already: a zombie its parent, or we, will reap)."""
    loop = asyncio.get_running_loop()
    fds = _pidfds(pids)
    try:
        running = [fd for fd in fds if not _exited(fd)]
        if not running:
            return False
        waits: list[asyncio.Future[None]] = []
        for fd in running:
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _on_exit, loop, fd, fut)
            waits.append(fut)
        try:
            await asyncio.wait(waits, timeout=timeout)
        finally:
            for fd in running:
                loop.remove_reader(fd)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def wait_exits(pids: Iterable[int], timeout: float) -> bool:
    """`exits` for a worker thread: blocks until every one of `pids` still running has
    exited or `timeout` passed; False when none of them was running."""
    fds = _pidfds(pids)
    try:
        running = {fd for fd in fds if not _exited(fd)}
        if not running:
            return False
        poller = select.poll()
        for fd in running:
            poller.register(fd, select.POLLIN)
        end = time.monotonic() + timeout
        while running and (left := end - time.monotonic()) > 0:
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                running.discard(fd)
                poller.unregister(fd)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _on_exit(loop: asyncio.AbstractEventLoop, fd: int, fut: asyncio.Future[None]) -> None:
    loop.remove_reader(fd)
    if not fut.done():
        fut.set_result(None)


def pid_alive(pid: int, proc: Path = Path("/proc")) -> bool:
    st = stat(pid, proc)
    return st is not None and st[0] != "Z"


def group_members(pgid: int, proc: Path = Path("/proc")) -> dict[int, Stat]:
    """Every live process in process group `pgid`, with its stat."""
    out = {}
    for pid in _pids(proc):
        st = stat(pid, proc)
        if st and st.pgid == pgid and st.state != "Z":
            out[pid] = st
    return out


def engine_remains(pid: int, start_time: int, pgid: int, session: int,
                   proc: Path = Path("/proc")) -> list[int]:
    """The live processes left of the engine tree whose root was `pid` (started at
    `start_time`, leading group `pgid` in `session`): the root and its descendants, and,
    the root gone or not, the members of its group and session. Root first; never us."""
    found: list[int] = []
    root = stat(pid, proc)
    if root is not None and root.start_time != start_time:
        # Someone else has the PID now. The kernel never reuses a PID that still names a
        # process group or session, so the engine's group is gone too.
        return []
    if root is not None and root.state != "Z":
        found = [pid, *descendants(pid, proc)]
    # Without its root, the group is still the engine's if its members are in the engine's
    # session and no older than the engine.
    for member, st in group_members(pgid, proc).items():
        if st.session == session and st.start_time >= start_time and member not in found:
            found.append(member)
    return [p for p in found if p != os.getpid()]
