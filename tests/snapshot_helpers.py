"""Helpers for the snapshot tests: real CRIU, a real counter server, a real store."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agent import proc
from agent.checkpoint.backend import CreateRequest, SnapshotInfo, take
from agent.checkpoint.criu import CriuBackend, DumpOptions
from agent.checkpoint.criu_locate import MIN_TEXT, CriuBinary, locate
from agent.checkpoint.snapshotter import Snapshotter
from agent.errors import SnapshotError
from agent.identity import Identity, collect
from agent.store import Canary, Manifest, ProcessTree, SnapshotKind, SnapshotStore
from tests.prereq import require

REPO = Path(__file__).resolve().parent.parent
COUNTER = REPO / "tests" / "workloads" / "counter.py"
CANARY = Canary(prompt="inc", max_tokens=1, text="1", token_ids=(1,))


T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
IDENT = collect(engine_kind="counter", engine_version="1", criu="4.1.1")


def publish(
    store: SnapshotStore, size: int = 1000, *, minutes: int = 0, ident=IDENT, chunk: int = 0,
    kind: SnapshotKind = "full",
) -> Manifest:
    """A snapshot with two image files of real bytes (the store does not care who wrote them)."""
    with store.begin(kind) as d:
        d.chunk_bytes = chunk or d.chunk_bytes
        (d.dir / "pages-1.img").write_bytes(os.urandom(size))
        (d.dir / "core-1.img").write_bytes(b"core")
        m = Manifest(
            id=d.id, kind=kind, created_at=T0 + timedelta(minutes=minutes), identity=ident,
            process=ProcessTree(root_pid=4242, pids=(4242,)), files=d.seal(),
            chunk_bytes=d.chunk_bytes, timings={"criu_dump": 0.1}, canary=CANARY,
        )  # fmt: skip
        d.publish(m)
    return m


def criu() -> CriuBinary:
    """The CRIU `make criu` installed; fails under CI=true, skips elsewhere, when missing."""
    try:
        return locate()
    except SnapshotError as e:
        require(False, f"CRIU >= {MIN_TEXT} is needed (run `make criu`): {e}")
        raise


def identity(criu_version: str = "4.1.1") -> Identity:
    return collect(engine_kind="counter", engine_version="1", criu=criu_version)


def snapshotter(root: Path, logs: Path) -> Snapshotter:
    return Snapshotter(SnapshotStore(root), CriuBackend(criu()), None, log_dir=logs)


def capture(snap: Snapshotter, pid: int, *, canary: Canary, identity: Identity,
            kind: SnapshotKind = "full", options: DumpOptions | None = None,
            held: dict[str, dict[str, Any]] | None = None) -> SnapshotInfo:
    """Dump the tree rooted at `pid` through `snap` into its store and publish it, as the
    agent's capture does (take); without `options.leave_running` CRIU kills the tree."""
    request = CreateRequest(kind=kind, pid=pid, canary=canary, held=held,
                            leave_running=(options or DumpOptions()).leave_running,
                            dump_options=options)
    return take(snap.store, snap, request, identity)


class Workload:
    """A test workload started as the supervisor starts an engine: its own session, stdin
    /dev/null, stdout and stderr one pipe to us; ready once it prints a line "ready..."."""

    def __init__(self, argv: list[str], sock: Path) -> None:
        self.sock = sock
        with proc.spawn_lock():
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            proc.own(self.popen.pid)
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        assert line.startswith(b"ready"), line
        self.pid = self.popen.pid

    def read_line(self) -> bytes:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline()

    def stop(self) -> None:
        """Kill it if CRIU did not, and reap it: its PID must be free for a restore."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        self.popen.wait(timeout=30)
        proc.disown(self.pid)
        if self.popen.stdout:
            self.popen.stdout.close()


class Counter(Workload):
    """tests/workloads/counter.py: a Unix-socket server whose state is a counter."""

    def __init__(self, sock: Path, ballast_mib: int = 0, *extra: str) -> None:
        super().__init__([sys.executable, str(COUNTER), str(sock), str(ballast_mib), *extra],
                         sock)

    def inc(self) -> int:
        return inc(self.sock)


def inc(sock: Path) -> int:
    """One request: the counter's new value."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(b"inc\n")
        return int(s.recv(64).split()[0])


def kill_and_reap(pid: int, timeout_s: float = 30) -> None:
    """SIGKILL a restored process (re-parented to us, the subreaper) and reap it, so its
    PID is free for the next restore: a killed restored process nobody reaps stays a zombie
    and keeps its PID."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            if not proc.pid_alive(pid):
                return
            got = 0
        if got == pid:
            return
        time.sleep(0.02)
    raise AssertionError(f"PID {pid} was not reaped within {timeout_s} s")


@pytest.fixture(autouse=True, scope="module")
def criu_present() -> None:
    """Autouse in a module that imports it: CRIU is a prerequisite of every test there."""
    criu()


@pytest.fixture(autouse=True, scope="module")
def subreaper() -> Iterator[None]:
    """Restored trees re-parent to the nearest subreaper: this test process."""
    proc.become_subreaper()
    yield
    proc.reap_orphans()
    ctypes.CDLL(None).prctl(proc.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@contextlib.contextmanager
def lock_held_elsewhere(path: Path) -> Iterator[None]:
    """Another process holds an exclusive flock on `path` (as another engine's dump or
    restore holds the link_remap lock) until the block ends."""
    holder = ("import fcntl, os, sys\n"
              "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "print('locked', flush=True)\nsys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", holder, str(path)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "locked\n"
        yield
    finally:
        p.kill()
        p.wait(timeout=30)
