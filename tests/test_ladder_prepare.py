"""Preparing a rung: off the event loop, typed refusals, and nothing kept for `start`; a
snapshot that failed set aside off the event loop too.

The store is the real one on a real file system, the holder socket a real Unix socket; the
snapshotter around the store stands in for CRIU (these tests are about the ladder above it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.errors import SnapshotError, StartPathError
from agent.metrics import Metrics, new_registry
from agent.recovery import Fall
from agent.refusal import Refusal, RefusalCode
from agent.status_text import format_status
from agent.store import Manifest, Retention, SnapshotStore
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.holder import HolderLink, WarmStart
from agent.supervisor.paths.restore import FullRestore
from agent.supervisor.status import AgentStatus, Fallthrough, Recovery
from tests.agentproc import agent_config
from tests.frontkit import socket_dir
from tests.loopkit import slow_disk, ticks_while
from tests.one_worker import OneWorker
from tests.snapshot_helpers import IDENT, publish


class SlowStore(SnapshotStore):
    """The real store, whose select takes a second more (a multi-GB image being hashed)."""

    def select(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return super().select(*args, **kwargs)


class StoreOnly:
    """A snapshotter without CRIU: the real store, and a restore that records what it was
    asked to restore and fails."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.restored: list[str] = []
        self.remaps: frozenset[str] = frozenset()

    def inspect(self, manifest: Manifest, image: Path) -> None:
        return None

    def restore(self, manifest: Manifest, image: Path, *, gpu_uuid: str | None = None) -> None:
        self.restored.append(manifest.id)
        raise SnapshotError(f"no CRIU in this test to restore {manifest.id}")


def _full(store: SnapshotStore, metrics: Metrics | None = None,
          identity=lambda: IDENT) -> tuple[FullRestore, StoreOnly]:
    snap = StoreOnly(store)
    rung = FullRestore(snapshotter=snap, unavailable="", adapter=OneWorker(),  # type: ignore[arg-type]
                       socket=store.root / "engine.sock", identity=identity,
                       metrics=metrics or Metrics(new_registry(), lambda: None),  # type: ignore
                       timeout_s=5)
    return rung, snap


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    s = SlowStore(tmp_path / "snaps")
    s.open(clean=True)
    return s


def test_choosing_a_snapshot_leaves_the_event_loop_running(store: SnapshotStore) -> None:
    m = publish(store)
    rung, _ = _full(store)
    t0 = time.monotonic()
    prepared, ticks = asyncio.run(ticks_while(rung.prepare(Attempt("crash"))))
    took = time.monotonic() - t0
    assert isinstance(prepared, Prepared) and prepared.plan.id == m.id
    assert took >= 1.0
    # A blocked loop ticks zero times in that second, a free one about a hundred.
    assert ticks.count >= 10, (ticks, took)


def test_asking_a_silent_holder_leaves_the_event_loop_running(tmp_path: Path,
                                                              tiny_model: Path) -> None:
    base = socket_dir()
    try:
        (base / "cpu").mkdir()
        # A holder that accepts and never answers: the client waits out its 2 s timeout.
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        silent.bind(str(base / "cpu" / "holder.sock"))
        silent.listen()
        cfg = parse_config(agent_config(tmp_path, tiny_model, holder={
            "enabled": True, "dir": str(base), "gpu": "cpu"}), "test")
        adapter = build_adapter(cfg)
        link = HolderLink(cfg.holder, cfg.paths.run, gpu=lambda: "cpu",
                          digest=lambda: "sha256-x", adapter=adapter)
        rung = WarmStart(adapter, link)
        t0 = time.monotonic()
        refusal, ticks = asyncio.run(ticks_while(rung.prepare(Attempt("crash"))))
        took = time.monotonic() - t0
        silent.close()
    finally:
        shutil.rmtree(base)
    assert isinstance(refusal, Refusal) and refusal.code is RefusalCode.HOLDER_DOWN, refusal
    assert took >= 1.0
    assert ticks.count >= 10, (ticks, took)


def test_a_failed_restore_sets_its_snapshot_aside_with_the_event_loop_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(tmp_path / "snaps", retention=Retention(
        keep=2, budget_bytes=64 << 30, quarantine_keep=1))
    store.open(clean=True)
    earlier = publish(store)
    # Set aside before with a multi-GB image (sparse: its size is what the retention counts).
    with open(store.path(earlier.id) / "pages-2.img", "wb") as f:
        f.truncate(8 << 30)
    store.quarantine(earlier.id, "an earlier failure")
    m = publish(store, minutes=1)
    rung, snap = _full(store)
    prepared = asyncio.run(rung.prepare(Attempt("crash")))
    assert isinstance(prepared, Prepared) and prepared.plan.id == m.id
    # The rename, the records written and the prune of the earlier image each wait on a
    # disk a dump is filling.
    slow_disk(monkeypatch, 0.15)

    async def fail() -> StartPathError:
        with pytest.raises(StartPathError) as e:
            await rung.start(Attempt("crash"), prepared)
        return e.value

    t0 = time.monotonic()
    refusal, ticks = asyncio.run(ticks_while(fail()))
    took = time.monotonic() - t0
    assert snap.restored == [m.id] and refusal.refusal.code is RefusalCode.RESTORE_FAILED
    [aside] = store.quarantined()
    assert (aside.id, aside.code) == (m.id, RefusalCode.RESTORE_FAILED)
    assert store.ids() == []  # and the earlier one, past quarantine_keep, deleted
    assert took >= 1.0
    assert ticks.count >= 10, (ticks, took)


def test_start_restores_what_prepare_returned_whatever_was_prepared_since(
        tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    store.open(clean=True)
    first = publish(store)
    rung, snap = _full(store)
    attempt = Attempt("crash")
    prepared = asyncio.run(rung.prepare(attempt))
    assert isinstance(prepared, Prepared) and prepared.plan.id == first.id
    assert prepared.canary is not None and prepared.canary.key == "snapshot:" + first.id
    assert "select" in prepared.stages and "select" not in attempt.stages
    # Another walk prepares meanwhile and finds a newer snapshot, then none at all.
    newer = publish(store, minutes=5)
    again = asyncio.run(rung.prepare(Attempt("crash")))
    assert isinstance(again, Prepared) and again.plan.id == newer.id
    store.delete(newer.id)
    store.delete(first.id)
    gone = asyncio.run(rung.prepare(Attempt("crash")))
    assert gone == Refusal(RefusalCode.NO_SNAPSHOT, "no snapshot yet")
    # The first start still restores exactly the snapshot its own prepare chose.
    with pytest.raises(StartPathError) as e:
        asyncio.run(rung.start(attempt, prepared))
    assert snap.restored == [first.id]
    assert e.value.refusal.code is RefusalCode.RESTORE_FAILED
    assert first.id in e.value.refusal.detail


def test_refused_snapshots_are_counted_by_their_code(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    store.open(clean=True)
    stale = publish(store, ident=IDENT.model_copy(update={"kernel": "5.15.0"}))
    corrupt = publish(store, minutes=1)
    (store.path(corrupt.id) / "core-1.img").write_bytes(b"CORE")
    (store.root / "20260101T000000Z-full-000000").write_bytes(b"not a directory")
    registry = new_registry()
    metrics = Metrics(registry, lambda: None)  # type: ignore[arg-type]
    rung, _ = _full(store, metrics)
    refusal = asyncio.run(rung.prepare(Attempt("crash")))
    assert isinstance(refusal, Refusal) and refusal.code is RefusalCode.NO_USABLE_SNAPSHOT
    # The words are made from each snapshot's code and detail, newest first.
    assert refusal.detail.startswith(f"no usable snapshot: {corrupt.id}: corrupt: ")
    assert f"{stale.id}: stale: kernel: '5.15.0' -> {IDENT.kernel!r}" in refusal.detail
    assert rung.stale_reasons == (RefusalCode.CORRUPT, RefusalCode.NOT_A_SNAPSHOT,
                                  RefusalCode.STALE)

    def rejected(reason: str) -> float:
        return registry.get_sample_value("pitstop_snapshots_rejected_total",
                                         {"reason": reason}) or 0.0

    assert [rejected(c) for c in ("stale", "corrupt", "not_a_snapshot")] == [1.0, 1.0, 1.0]
    # The corrupt one is quarantined; the stale one may serve another host's identity.
    assert store.ids() == ["20260101T000000Z-full-000000", stale.id]


def test_a_stale_snapshot_passed_over_by_every_walk_and_rung_is_counted_once(
        tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    store.open(clean=True)
    publish(store, ident=IDENT.model_copy(update={"kernel": "5.15.0"}))
    registry = new_registry()
    metrics = Metrics(registry, lambda: None)  # type: ignore[arg-type]
    rung, _ = _full(store, metrics)
    twin, _ = _full(store, metrics)  # another rung of the same kind, as refill is to hybrid
    for _walk in range(3):
        for r in (rung, twin):
            refusal = asyncio.run(r.prepare(Attempt("crash")))
            assert isinstance(refusal, Refusal), refusal
            assert refusal.code is RefusalCode.NO_USABLE_SNAPSHOT
    assert registry.get_sample_value("pitstop_snapshots_rejected_total",
                                     {"reason": "stale"}) == 1.0
    # A second stale snapshot is a second refusal.
    publish(store, minutes=1, ident=IDENT.model_copy(update={"kernel": "5.16.0"}))
    asyncio.run(rung.prepare(Attempt("crash")))
    assert registry.get_sample_value("pitstop_snapshots_rejected_total",
                                     {"reason": "stale"}) == 2.0


def test_a_snapshot_of_the_other_kind_is_neither_refused_nor_stale(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    store.open(clean=True)
    publish(store)  # a full snapshot: the full rung's to restore
    metrics = Metrics(new_registry(), lambda: None)  # type: ignore[arg-type]
    rung, _ = _full(store, metrics)
    rung.kind = "hybrid"  # the hybrid rung's view of the same store
    refusal = asyncio.run(rung.prepare(Attempt("crash")))
    assert isinstance(refusal, Refusal) and refusal.code is RefusalCode.NO_SNAPSHOT, refusal
    assert refusal.detail == "no snapshot yet" and rung.stale_reasons == ()
    counted = [smp for fam in metrics.snapshots_rejected.collect() for smp in fam.samples
               if smp.value]
    assert counted == [], counted


def test_status_shows_each_fallthrough_with_its_code_and_detail() -> None:
    status = AgentStatus()
    status.last_recovery = Recovery(
        path="cold", cause="crash", result="success", duration_s=1.0, at=0.0,
        fallthroughs=[Fallthrough("hybrid", Fall.SKIPPED, Refusal(
            RefusalCode.DISABLED, "no holder configured (holder.enabled: false)"))])
    data = json.loads(json.dumps(status.to_json()))
    assert data["last_recovery"]["fallthroughs"] == [{
        "path": "hybrid", "kind": "skipped",
        "refusal": {"code": "disabled", "detail": "no holder configured (holder.enabled: false)"}}]
    assert ("  fell through: hybrid skipped: no holder configured (holder.enabled: false) "
            "(disabled)") in format_status(data).splitlines()
