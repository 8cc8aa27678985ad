"""Real CRIU on a process that keeps state where vLLM does: TCP, /dev/shm, a socket path."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import proc
from agent.checkpoint import outside
from agent.checkpoint.connections import Outside
from agent.checkpoint.criu import DumpOptions
from agent.checkpoint.snapshotter import Snapshotter
from agent.errors import OpenConnectionsError, SnapshotError
from agent.store import Manifest
from tests.snapshot_helpers import (
    CANARY,
    REPO,
    Workload,
    capture,
    identity,
    kill_and_reap,
    lock_held_elsewhere,
    snapshotter,
    subreaper,  # noqa: F401 - autouse: this process reaps restored trees
)

pytestmark = pytest.mark.integration

TALKER = REPO / "tests" / "workloads" / "talker.py"


class Talker(Workload):
    """tests/workloads/talker.py: loopback TCP, /dev/shm state and a socket path."""

    def __init__(self, sock: Path, *extra: str) -> None:
        super().__init__([sys.executable, str(TALKER), str(sock), *extra], sock)


def ping(sock: Path) -> tuple[int, int, int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(b"ping\n")
        a, b, c = s.recv(64).split()
        return int(a), int(b), int(c)


@pytest.fixture
def shm_clean() -> Iterator[None]:
    yield
    for p in glob.glob("/dev/shm/pitstop-test-*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def test_a_running_tree_with_internal_tcp_and_shared_memory_restores_twice_as_dumped(
        tmp_path: Path, shm_clean: None):
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    t = Talker(tmp_path / "t.sock")
    assert ping(t.sock) == (1, 1, 1)
    info = capture(snap, t.pid, canary=CANARY, identity=identity(snap.criu.version),
                        options=DumpOptions(leave_running=True))
    m = info.manifest
    # Both ends of the connection are in the tree: dumped, with no network lock.
    flags = m.criu_flags
    assert "--tcp-established" in flags and flags[flags.index("--network-lock") + 1] == "skip"
    # The mapped /dev/shm file and CRIU's link to the unlinked one are in the image.
    assert f"pitstop-test-{t.pid}" in m.process.shm_files
    assert any(n.startswith("link_remap.") for n in m.process.shm_files), m.process
    assert m.process.socket_paths == (str(t.sock),)
    # Left running, the process changes its shared memory after the dump.
    assert [ping(t.sock) for _ in range(3)][-1] == (4, 4, 4)
    t.stop()
    # Its socket file stays behind, as a killed engine's do.
    assert t.sock.exists()
    for _ in range(2):
        chosen = snap.store.select(identity(snap.criu.version)).chosen
        assert chosen is not None and chosen.id == info.id
        r = snap.restore(chosen)
        try:
            assert r.pid == t.pid
            # The counters continue from the dump, not from what the live process wrote
            # after it, and the restored TCP connection carries data.
            assert ping(t.sock) == (2, 2, 2)
        finally:
            kill_and_reap(r.pid)
            for f in set(r.outputs.values()):
                f.close()
    assert snap.store.verify(info.id).ok


def test_a_tcp_connection_to_outside_the_tree_refuses_the_snapshot_and_names_it(
        tmp_path: Path, shm_clean: None):
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    outside = socket.socket()
    outside.bind(("127.0.0.1", 0))
    outside.listen(1)
    port = outside.getsockname()[1]
    t = Talker(tmp_path / "t.sock", "--peer", f"127.0.0.1:{port}")
    accepted, _ = outside.accept()
    try:
        with pytest.raises(OpenConnectionsError) as refused:
            capture(snap, t.pid, canary=CANARY, identity=identity(snap.criu.version),
                         options=DumpOptions(leave_running=True))
        said = str(refused.value)
        assert f"PID {t.pid} (python" in said and f"peer 127.0.0.1:{port}" in said, said
        [conn] = refused.value.connections
        assert (conn.reason, conn.holder.pid, conn.peer) == (
            Outside.TCP_PEER, t.pid, f"127.0.0.1:{port}")
        # The peer's holder is named: this test process.
        assert os.getpid() in [h.pid for h in conn.peer_holders]
        # Refused before CRIU ran: nothing published, the process serves on.
        assert snap.store.entries() == []
        assert ping(t.sock) == (1, 1, 0)
    finally:
        t.stop()
        accepted.close()
        outside.close()


def test_a_link_remap_left_by_a_killed_criu_is_removed_before_the_next_dump(
        tmp_path: Path, shm_clean: None):
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    t = Talker(tmp_path / "t.sock")
    try:
        first = capture(snap, t.pid, canary=CANARY, identity=identity(snap.criu.version),
                             options=DumpOptions(leave_running=True))
        remap = min(n for n in first.manifest.process.shm_files if n.startswith("link_remap."))
        # What a CRIU killed mid-dump leaves: its link to the file, under the same name the
        # next dump of this tree wants.
        os.link(f"/dev/shm/pitstop-test-{t.pid}-sem", f"/dev/shm/{remap}")
        second = capture(snap, t.pid, canary=CANARY, identity=identity(snap.criu.version),
                              options=DumpOptions(leave_running=True))
        assert remap in second.manifest.process.shm_files
        assert not os.path.exists(f"/dev/shm/{remap}")
    finally:
        t.stop()



def test_a_dump_or_restore_holds_the_hosts_link_remap_names_alone(tmp_path: Path):
    """Two agents' CRIU runs on one host would use the same link_remap.N in /dev/shm."""
    probe = ("import fcntl, os, sys\n"
             "fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except BlockingIOError:\n    sys.exit(3)\n")
    lock = tmp_path / outside.REMAP_LOCK
    with outside.remap_window(tmp_path):
        held = subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=30)
    free = subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=30)
    assert (held.returncode, free.returncode) == (3, 0)


def test_the_wait_for_another_engines_dump_or_restore_is_measured(tmp_path: Path):
    """Two engines restored at once on one host: the second one's wait for the link_remap lock
    is its own restore stage (remap_wait), not time no stage accounts for."""
    waited: list[float] = []

    def take() -> None:
        with outside.remap_window(tmp_path) as waited_s:
            waited.append(waited_s)

    t = threading.Thread(target=take)
    with lock_held_elsewhere(tmp_path / outside.REMAP_LOCK):
        t.start()
        # Blocked for certain (the kernel lists a waiter with "->"), then 0.3 s more.
        end = time.monotonic() + 30
        while " -> FLOCK " not in Path("/proc/locks").read_text():
            assert time.monotonic() < end, "the lock was never waited for"
            time.sleep(0.01)
        time.sleep(0.3)
    t.join(timeout=30)
    assert waited and waited[0] >= 0.3


def _gone(pid: int, within_s: float) -> bool:
    """Whether `pid` runs no more (a zombie of ours, the subreaper, counts as gone) within
    `within_s`."""
    end = time.monotonic() + within_s
    while proc.pid_alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _dumped_talker(tmp_path: Path) -> tuple[Snapshotter, Manifest, Talker]:
    """A Talker dumped (left running, then killed as a crash would): the snapshotter, the
    snapshot's manifest, and the talker."""
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    t = Talker(tmp_path / "t.sock")
    info = capture(snap, t.pid, canary=CANARY, identity=identity(snap.criu.version),
                   options=DumpOptions(leave_running=True))
    t.stop()
    return snap, info.manifest, t


def test_a_restore_that_fails_in_criu_takes_back_the_shm_copies_it_put_back(
        tmp_path: Path, shm_clean: None):
    snap, m, t = _dumped_talker(tmp_path)
    # Not a stale socket, which the restore would remove, but a directory at the path the
    # tree binds: CRIU's bind fails after the copies are in /dev/shm.
    t.sock.unlink()
    t.sock.mkdir()
    with pytest.raises(SnapshotError):
        snap.restore(m)
    assert m.process.shm_files, m.process
    left = [n for n in m.process.shm_files if (outside.SHM_DIR / n).exists()]
    assert not left, f"copies left in /dev/shm after the failed restore: {left}"
    assert _gone(t.pid, 10), "a process of the failed restore still runs"


def test_a_restore_that_fails_after_criu_kills_the_tree_and_takes_back_its_copies(
        tmp_path: Path, shm_clean: None, monkeypatch: pytest.MonkeyPatch):
    snap, m, t = _dumped_talker(tmp_path)
    restored: list[int] = []

    def cuda_restore_fails(pids: tuple[int, ...], timings: dict[str, float], **_: object):
        # Where a GPU's tree has its CUDA state restored (none here): the tree runs.
        restored.append(ping(t.sock)[0])
        raise SnapshotError("cuda-checkpoint --action restore failed (injected)")

    monkeypatch.setattr(snap, "_resume", cuda_restore_fails)
    with pytest.raises(SnapshotError, match="injected"):
        snap.restore(m)
    assert restored == [1], "the restored tree answered before its CUDA restore failed"
    # The remapped file CRIU consumed; the copy it mapped under its name, taken back.
    left = [n for n in m.process.shm_files if (outside.SHM_DIR / n).exists()]
    assert not left, f"copies left in /dev/shm after the failed restore: {left}"
    assert _gone(t.pid, 10), "the tree of the failed restore still runs"
