"""Real CRIU: dump and restore a real process through the Snapshotter and the store."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent import proc
from agent.checkpoint.criu import DumpOptions
from agent.errors import SnapshotError
from agent.store import Retention
from tests.prereq import require
from tests.snapshot_helpers import (
    CANARY,
    REPO,
    Counter,
    Workload,
    capture,
    identity,
    inc,
    kill_and_reap,
    snapshotter,
    subreaper,  # noqa: F401 - autouse: this process reaps restored trees
)

pytestmark = pytest.mark.integration

PTRACE_SEIZE = 0x4206


def test_restore_one_image_three_times_state_continues_same_pid_pipe_rewired(tmp_path: Path):
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    c = Counter(tmp_path / "c.sock", 4)
    assert c.inc() == 1
    assert c.read_line() == b"count 1\n"
    info = capture(snap, c.pid, canary=CANARY, identity=identity(snap.criu.version))
    c.stop()  # CRIU killed it after the dump; reap it so its PID is free again
    m = info.manifest
    assert m.process.root_pid == c.pid and m.process.pids == (c.pid,)
    assert m.process.inherited_pipes["1"] == m.process.inherited_pipes["2"]
    assert m.timings["criu_dump"] > 0 and info.image_bytes > 4 << 20
    assert {"pstree.img", "inventory.img"} <= {f.name for f in m.files}

    # CRIU logs restores at warnings and errors unless snapshots.restore_log_level says 4.
    for level in (None, None, 4):
        if level is not None:
            snap.criu.restore_verbosity = level
        chosen = snap.store.select(identity(snap.criu.version)).chosen
        assert chosen is not None and chosen.id == info.id
        r = snap.restore(chosen)
        try:
            assert ("Forking task" in r.log_path.read_text()) is (level == 4)
            assert r.pid == c.pid
            assert inc(c.sock) == 2  # the count continued from the dump
            assert r.outputs[1].readline() == b"count 2\n"  # stdout came back to us
            assert r.outputs[2] is r.outputs[1]
        finally:
            kill_and_reap(r.pid)
            for f in set(r.outputs.values()):
                f.close()
    assert snap.store.verify(info.id).ok  # CRIU's stats-restore does not break it


def test_leave_running_keeps_serving_and_the_image_restores_the_dump_time_state(tmp_path: Path):
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    c = Counter(tmp_path / "c.sock")
    try:
        assert c.inc() == 1
        info = capture(
            snap, c.pid, canary=CANARY, identity=identity(snap.criu.version),
            options=DumpOptions(leave_running=True),
        )  # fmt: skip
        assert c.inc() == 2 and c.inc() == 3
    finally:
        c.stop()
    r = snap.restore(info.manifest)
    try:
        assert inc(c.sock) == 2
        # Retention: a second capture with keep=1 replaces the first, and only after publishing.
        snap.store.retention = Retention(keep=1, budget_bytes=1 << 40)
        second = capture(
            snap, r.pid, canary=CANARY, identity=identity(snap.criu.version),
            options=DumpOptions(leave_running=True),
        )  # fmt: skip
        assert snap.store.ids() == [second.id]
    finally:
        kill_and_reap(r.pid)
        for f in set(r.outputs.values()):
            f.close()


def test_a_failed_dump_names_the_criu_error_publishes_nothing_and_the_process_serves_on(
    tmp_path: Path,
):
    # A process another tracer holds: CRIU cannot seize it, a real CRIU failure.
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    c = Counter(tmp_path / "c.sock")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.ptrace(PTRACE_SEIZE, c.pid, 0, 0) == 0, os.strerror(ctypes.get_errno())
    try:
        with pytest.raises(SnapshotError) as e:
            capture(snap, c.pid, canary=CANARY, identity=identity(snap.criu.version))
        msg = str(e.value)
        assert f"criu dump of PID {c.pid} failed: " in msg
        first = msg.split("failed: ", 1)[1].splitlines()[0]
        assert "Error (" in first and "RLIMIT_NOFILE" not in first, first
        assert "full log: " in msg
        assert c.inc() == 1  # still serving
        assert snap.store.entries() == []
        assert [n for n in os.listdir(snap.store.root) if n.startswith(".tmp-")] == []
    finally:
        c.stop()


def test_an_agent_killed_during_the_dump_leaves_the_previous_good_snapshot(tmp_path: Path):
    root, logs = tmp_path / "snaps", tmp_path / "logs"
    snap = snapshotter(root, logs)
    ident = identity(snap.criu.version)
    first = Counter(tmp_path / "a.sock")
    good = capture(snap, first.pid, canary=CANARY, identity=ident)
    first.stop()

    big = Counter(tmp_path / "b.sock", 256)
    agent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from tests.snapshot_helpers import CANARY, capture, identity, snapshotter
            snap = snapshotter(Path({str(root)!r}), Path({str(logs)!r}))
            capture(snap, {big.pid}, canary=CANARY, identity=identity(snap.criu.version))
        """)],
        cwd=REPO,
    )
    try:
        # Kill the capturing agent once CRIU has started writing pages into the draft.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            drafts = [d for d in root.iterdir() if d.name.startswith(".tmp-")]
            if drafts and any(p.name.startswith("pages-") for p in drafts[0].iterdir()):
                break
            time.sleep(0.005)
        else:
            pytest.fail("the draft never received pages")
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        sel = snap.store.select(ident)
        assert sel.chosen is not None and sel.chosen.id == good.id
        assert sel.skipped == ()
    finally:
        _wait_for_orphaned_criu(big)
    snap.store.open(clean=True)  # what the agent does at its next start
    assert os.listdir(root) == [good.id]


def _wait_for_orphaned_criu(c: Counter) -> None:
    """The orphaned CRIU finishes (and kills the counter) or not; end both, reap all."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
        "criu" in _comm(p) for p in proc.children_of(os.getpid())
    ):
        proc.reap_orphans()
        time.sleep(0.05)
    c.stop()
    proc.reap_orphans()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_full_disk_publishes_nothing_partial(tmp_path: Path):
    require(os.geteuid() == 0, "mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(small)],
                       capture_output=True, text=True)  # fmt: skip
    require(r.returncode == 0, f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        snap = snapshotter(small / "snaps", tmp_path / "logs")
        ident = identity(snap.criu.version)
        c = Counter(tmp_path / "a.sock")
        good = capture(snap, c.pid, canary=CANARY, identity=ident)
        c.stop()
        big = Counter(tmp_path / "b.sock", 64)
        try:
            with pytest.raises(SnapshotError, match="criu dump of PID") as e:
                capture(snap, big.pid, canary=CANARY, identity=ident)
            print(e.value)
            assert big.inc() == 1  # the failed dump left it running
        finally:
            big.stop()
        assert [e.id for e in snap.store.entries()] == [good.id]
        assert os.listdir(snap.store.root) == [good.id]
        assert snap.store.select(ident).chosen is not None
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)



def test_a_hybrid_image_leaves_zero_pages_out_and_restores_the_same_memory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    # Private anonymous pages of zeros are not in the image (the restore maps them fresh);
    # a private file page written with zeros is, or it would come back as the file's bytes.
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    sock = tmp_path / "z.sock"
    w = Workload([sys.executable, str(REPO / "tests" / "workloads" / "zeros.py"), str(sock),
                  str(tmp_path / "backing")], sock)

    def ask() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(sock))
            s.sendall(b"sum\n")
            return s.recv(256).decode()

    before = ask()
    assert before.split()[1:] == ["0", "171"]  # the zeroed file page, the file's 0xab
    with caplog.at_level(logging.INFO, logger="pitstop.snapshot"):
        info = capture(snap, w.pid, canary=CANARY, identity=identity(snap.criu.version),
                            kind="hybrid")
    w.stop()
    left = [int(m.split()[1]) for m in caplog.messages if m.startswith("left ")]
    assert left and left[0] >= 4096 * 2 // 3  # the workload's zeroed pages at least
    image = snap.store.root / info.id
    zero, pages = bytes(4096), b"".join(p.read_bytes() for p in image.glob("pages-*.img"))
    zeros = sum(pages[i:i + 4096] == zero for i in range(0, len(pages), 4096))
    assert 1 <= zeros < 64  # the file's zeroed page stayed (and little else)
    r = snap.restore(info.manifest)
    try:
        assert ask() == before
    finally:
        kill_and_reap(r.pid)
        for f in set(r.outputs.values()):
            f.close()
    assert snap.store.verify(info.id).ok
