"""CRIU's lazy restore (snapshots.lazy_restore): the tree runs before its image is read, its
memory comes back the same, a dump waits for the transfer, and a page daemon that dies takes
its tree down rather than leave it reading zeros."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent import proc
from agent.checkpoint.backend import RestoredProcess
from agent.checkpoint.criu import CriuBackend
from agent.checkpoint.snapshotter import Snapshotter
from agent.commands import CommandResult
from agent.commands import run as real_run
from agent.store import Manifest, SnapshotStore
from tests.agentproc import RunningAgent, agent_config, complete, snapshot_list
from tests.prereq import require
from tests.snapshot_helpers import (
    CANARY,
    REPO,
    Counter,
    Workload,
    capture,
    criu,
    identity,
    kill_and_reap,
    subreaper,  # noqa: F401 - autouse: this process reaps restored trees
)

pytestmark = pytest.mark.integration

ZEROS = REPO / "tests" / "workloads" / "zeros.py"
TRANSFERRED = re.compile(r"UFFD transferred pages: \((\d+)/(\d+)\)")


@pytest.fixture(autouse=True, scope="module")
def userfaultfd() -> None:
    r = real_run([str(criu().path), "check", "--feature", "uffd-noncoop"], timeout_s=60,
                 check=False)
    require(r.ok, "this kernel cannot serve a restored tree's pages by userfaultfd "
                  f"(`criu check --feature uffd-noncoop`): {r.stdout}{r.stderr}")


def _snapshotter(tmp: Path, runner=real_run) -> Snapshotter:
    return Snapshotter(SnapshotStore(tmp / "snaps"), CriuBackend(criu(), runner), None,
                       log_dir=tmp / "logs", lazy_restore=True)


def _zeros(tmp: Path) -> tuple[Workload, Path]:
    sock = tmp / "z.sock"
    return Workload([sys.executable, str(ZEROS), str(sock), str(tmp / "backing")], sock), sock


def _ask(sock: Path) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(sock))
        s.sendall(b"sum\n")
        return s.recv(256).decode()


def _counted_once(snap: Snapshotter, tmp: Path, ballast_mib: int) -> tuple[Counter, Manifest]:
    """A counter at 1, dumped (CRIU ends it) and published: restores continue at 2."""
    c = Counter(tmp / "c.sock", ballast_mib)
    assert c.inc() == 1
    info = capture(snap, c.pid, canary=CANARY, identity=identity(snap.criu.version))
    c.stop()
    return c, info.manifest


def _end(r: RestoredProcess) -> None:
    kill_and_reap(r.pid)
    for f in set(r.outputs.values()):
        f.close()


def _transferred(logs: Path) -> list[tuple[int, int]]:
    """(pages handed over by userfaultfd, pages it had to hand over) per process, from the
    lazy-pages daemons' logs."""
    return [(int(a), int(b)) for log in logs.glob("*-lazy-pages-*.log")
            for a, b in TRANSFERRED.findall(log.read_text(errors="replace"))]


def test_a_lazy_restore_hands_the_memory_over_by_userfaultfd_and_it_is_the_same(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    snap = _snapshotter(tmp_path)
    w, sock = _zeros(tmp_path)
    before = _ask(sock)
    info = capture(snap, w.pid, canary=CANARY, identity=identity(snap.criu.version),
                   kind="hybrid")  # zero pages left out of the image, as a hybrid's are
    w.stop()
    with caplog.at_level(logging.INFO, logger="pitstop.snapshot"):
        r = snap.restore(info.manifest)
        try:
            assert "lazy_pages_start" in r.timings
            assert _ask(sock) == before
            # A dump of the restored tree waits until every page is in place.
            again = capture(snap, r.pid, canary=CANARY, identity=identity(snap.criu.version),
                            kind="hybrid")
        finally:
            _end(r)
    assert any("every page of the lazy restore in place" in m for m in caplog.messages)
    moved = _transferred(tmp_path / "logs")
    assert moved and sum(n for n, _ in moved) > 4096 // 3  # the workload's pages with content
    assert all(n == total for n, total in moved), moved
    assert not list((tmp_path / "logs").glob("lazy-*/"))  # each daemon's socket dir removed
    # The image dumped after the lazy restore holds the same memory.
    r2 = snap.restore(again.manifest)
    try:
        assert _ask(sock) == before
    finally:
        _end(r2)
    assert snap.store.verify(info.id).ok and snap.store.verify(again.id).ok


def test_a_page_daemon_that_dies_mid_transfer_takes_its_restored_tree_down(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    # 1 GiB takes the daemon a quarter of a second or more to hand over; it is killed the
    # moment the restore returns. Left running, the tree would read zeros where its
    # memory was not handed over yet.
    snap = _snapshotter(tmp_path)
    _, manifest = _counted_once(snap, tmp_path, 1024)
    with caplog.at_level(logging.INFO, logger="pitstop.snapshot"):
        r = snap.restore(manifest)
        [pages] = snap.page_servers
        os.kill(pages.process.pid, signal.SIGKILL)
        try:
            assert pages.wait(30)
            deadline = time.monotonic() + 30
            while proc.pid_alive(r.pid) and time.monotonic() < deadline:
                proc.reap_orphans()
                time.sleep(0.05)
            assert not proc.pid_alive(r.pid), "the tree the dead daemon served still runs"
        finally:
            _end(r)
    assert pages.returncode == -signal.SIGKILL
    assert any("lazy-pages daemon killed by signal 9" in m and "is killed" in m
               for m in caplog.messages), caplog.messages
    assert snap.store.verify(manifest.id).ok  # the image is not at fault


def test_a_kernel_without_userfaultfd_for_restores_reads_the_image_first(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    def no_uffd(argv: Sequence[str], **kw) -> CommandResult:
        if list(argv[1:]) == ["check", "--feature", "uffd-noncoop"]:
            return CommandResult(tuple(argv), 1, "", "uffd-noncoop is not supported", 0.0)
        return real_run(argv, **kw)

    snap = _snapshotter(tmp_path, no_uffd)
    c, manifest = _counted_once(snap, tmp_path, 4)
    with caplog.at_level(logging.WARNING, logger="pitstop.snapshot"):
        r = snap.restore(manifest)
    try:
        assert c.inc() == 2
        assert "lazy_pages_start" not in r.timings and not snap.page_servers
    finally:
        _end(r)
    assert any("uffd-noncoop` fails" in m for m in caplog.messages), caplog.messages
    assert not _transferred(tmp_path / "logs")


def test_the_agent_with_lazy_restore_comes_back_from_a_kill_and_snapshots_again(
        tmp_path: Path, tiny_model: Path):
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model,
                                            snapshots={"lazy_restore": True}))
    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        before = complete(a)
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(1)["last_recovery"]
        assert (rec["path"], rec["result"]) == ("full", "success"), rec
        assert complete(a) == before
        a.wait_for(lambda s: "every page of the lazy restore in place" in a.log(), 60,
                   "the lazy restore's last page")
        # A snapshot of the lazily restored engine, then a kill restored from it.
        r = a.pitstop("snapshot", "create")
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(snapshot_list(a)) == 2
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(2)["last_recovery"]
        assert (rec["path"], rec["result"]) == ("full", "success"), rec
        assert complete(a) == before
        # Both restores were lazy: each had its daemon, which handed every page over.
        moved = _transferred(Path(a.config["paths"]["state_dir"]) / "run" / "criu")
        assert moved and all(n == total for n, total in moved), moved
    finally:
        a.stop()
