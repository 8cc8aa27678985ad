"""A restore waits for the PIDs of its image; one still taken is the host's failure, not the
image's: nothing runs, and the snapshot is not quarantined."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.checkpoint.criu import CriuBackend
from agent.checkpoint.snapshotter import ZOMBIES_AGAIN_S, Snapshotter
from agent.errors import RestoreBlockedError, SnapshotError, StartPathError
from agent.metrics import Metrics
from agent.refusal import RefusalCode
from agent.store import Manifest, ProcessTree, SnapshotStore
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.restore import FullRestore
from tests.one_worker import OneWorker
from tests.snapshot_helpers import CANARY, IDENT, T0, criu


def _publish(store: SnapshotStore, pids: tuple[int, ...]) -> Manifest:
    """A snapshot whose process tree was `pids` (its image is bytes CRIU would refuse)."""
    with store.begin("full") as d:
        (d.dir / "core-1.img").write_bytes(b"core")
        m = Manifest(id=d.id, kind="full", created_at=T0, identity=IDENT,
                     process=ProcessTree(root_pid=pids[0], pids=pids), files=d.seal(),
                     chunk_bytes=d.chunk_bytes, timings={}, canary=CANARY)
        d.publish(m)
    return m


def _snapshotter(tmp: Path, wait_s: float, **kw: object) -> Snapshotter:
    return Snapshotter(SnapshotStore(tmp / "snaps"), CriuBackend(criu()), None,
                       log_dir=tmp / "logs", pid_wait_s=wait_s, **kw)  # type: ignore[arg-type]


def _rung(snap: Snapshotter, tmp: Path) -> FullRestore:
    return FullRestore(
        snapshotter=snap, unavailable="", adapter=OneWorker(),  # type: ignore[arg-type]
        socket=tmp / "e.sock", identity=lambda: IDENT, timeout_s=10,
        metrics=Metrics(CollectorRegistry(), status=lambda: None),  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_pid_still_taken_fails_the_restore_and_keeps_the_snapshot(tmp_path: Path):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        snap = _snapshotter(tmp_path, wait_s=0.3)
        m = _publish(snap.store, (holder.pid,))
        rung = _rung(snap, tmp_path)
        attempt = Attempt(cause="test")
        prepared = asyncio.run(rung.prepare(attempt))
        assert isinstance(prepared, Prepared), prepared
        t0 = time.monotonic()
        with pytest.raises(StartPathError) as e:
            asyncio.run(rung.start(attempt, prepared))
        assert time.monotonic() - t0 >= 0.3  # it waited for the PID first
        assert isinstance(e.value.__cause__, RestoreBlockedError)
        assert e.value.refusal.code is RefusalCode.PID_TAKEN
        msg = str(e.value)
        assert f"PID {holder.pid}, which the restore must give back" in msg
        assert f"process {holder.pid} (sleep) holds it as its PID" in msg
        # Not the image's fault: still published, nothing quarantined, chosen again next time.
        assert snap.store.ids() == [m.id]
        assert not (snap.store.root / ".quarantine").exists()
        again = asyncio.run(rung.prepare(Attempt(cause="test")))
        assert isinstance(again, Prepared) and again.plan.id == m.id
    finally:
        holder.kill()
        holder.wait()


def test_a_pid_freed_within_the_wait_lets_the_restore_run(tmp_path: Path, caplog):
    holder = subprocess.Popen(["sleep", "0.5"])
    reaped = threading.Thread(target=holder.wait)
    reaped.start()
    slept: list[float] = []
    snap = _snapshotter(tmp_path, wait_s=30, sleep=slept.append)
    m = _publish(snap.store, (holder.pid,))
    # CRIU ran (and refused the fake image): the PID was free by then.
    with caplog.at_level("INFO", logger="pitstop.snapshot"), pytest.raises(SnapshotError) as e:
        snap.restore(m)
    assert not isinstance(e.value, RestoreBlockedError), e.value
    reaped.join()
    # Woken by the holder's exit, not by polling while it ran: the only pauses are the
    # short ones for its reap, once it had exited.
    assert set(slept) <= {ZOMBIES_AGAIN_S}, slept
    # The wait is said, with who held the PID.
    assert f"for its PIDs (PID {holder.pid} by {holder.pid} (sleep, state S))" in caplog.text
