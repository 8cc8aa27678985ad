"""The status view: a scrape reads what the agent published, and does no I/O of its own."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from agent.config import parse_config
from agent.holder.client import HolderClient
from agent.store import SnapshotStore
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.holder_proc import Holder
from tests.snapshot_helpers import criu, publish

# An audit hook cannot be removed: it records only while a test switches it on.
_recording: list[str] | None = None
IO_EVENTS = ("open", "os.", "socket.", "subprocess.", "shutil.", "glob.")


def _audit(event: str, args: tuple) -> None:
    if _recording is not None and event.startswith(IO_EVENTS):
        _recording.append(event)


sys.addaudithook(_audit)


def _scrape_recording_io(registry) -> tuple[str, list[str]]:
    global _recording
    _recording = []
    try:
        text = generate_latest(registry).decode()
    finally:
        seen, _recording = _recording, None
    return text, seen


def _sample(text: str, name: str) -> str | None:
    return next((line.split()[-1] for line in text.splitlines() if line.startswith(name)), None)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    h = Holder(tmp_path / "holder")
    yield h
    h.stop()


@pytest.fixture
def agent(tmp_path: Path, tiny_model: Path, holder: Holder):
    """The real wiring (snapshots on, a real CPU holder), one snapshot in its real store,
    and one refresh of the view done."""
    criu()
    from agent.wiring import Agent

    cfg = parse_config(agent_config(tmp_path, tiny_model, holder={
        "enabled": True, "dir": str(holder.base), "gpu": "cpu"}), "test")
    a = Agent.start(cfg, None, Notifier({}))
    assert a.snapshotter is not None
    publish(a.snapshotter.store)
    asyncio.run(a.board.refresh())
    return a


def test_the_view_has_the_store_and_holder_facts_after_a_refresh(agent) -> None:
    text = generate_latest(agent.registry).decode()
    assert 'pitstop_snapshot_present{kind="full"} 1.0' in text
    on_disk = agent.snapshotter.store.entries()[0].bytes_on_disk
    assert _sample(text, "pitstop_snapshot_size_bytes") == str(float(on_disk))
    assert _sample(text, "pitstop_holder_up") == "1.0"
    assert _sample(text, "pitstop_holder_bytes") == "0.0"
    assert agent.status.holder is not None and agent.status.holder.up
    assert agent.status.newest_snapshot is not None
    assert agent.status.to_json()["newest_snapshot"]["kind"] == "full"


def test_a_scrape_with_the_store_and_the_holder_gone_answers_and_does_no_io(
        agent, holder: Holder, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.rmtree(agent.snapshotter.store.root)
    holder.stop()

    def no_io(*args: object, **kwargs: object) -> None:
        raise AssertionError("the collector touched the store or the holder")

    monkeypatch.setattr(SnapshotStore, "entries", no_io)
    monkeypatch.setattr(SnapshotStore, "ids", no_io)
    monkeypatch.setattr(HolderClient, "__init__", no_io)
    text, io = _scrape_recording_io(agent.registry)
    assert io == [], f"a scrape made these I/O calls: {io}"
    assert 'pitstop_snapshot_present{kind="full"} 1.0' in text
    assert _sample(text, "pitstop_holder_up") == "1.0"  # what the last poll saw


def test_the_next_poll_after_the_holder_went_away_says_it_is_down(agent, holder: Holder) -> None:
    holder.stop()
    asyncio.run(agent.board.refresh())
    text, io = _scrape_recording_io(agent.registry)
    assert io == []
    assert _sample(text, "pitstop_holder_up") == "0.0"
    assert _sample(text, "pitstop_holder_bytes") is None


def test_a_store_that_cannot_be_read_keeps_the_last_facts(agent) -> None:
    root = agent.snapshotter.store.root
    os.chmod(root, 0o777)  # the store refuses a world-writable root (root reads it anyway)
    try:
        asyncio.run(agent.board.refresh())
    finally:
        os.chmod(root, 0o700)
    text, io = _scrape_recording_io(agent.registry)
    assert io == [] and 'pitstop_snapshot_present{kind="full"} 1.0' in text


def test_a_prune_deleting_a_snapshot_while_the_store_is_listed_fails_no_refresh_or_scrape(
        agent, monkeypatch: pytest.MonkeyPatch) -> None:
    store = agent.snapshotter.store
    doomed = [publish(store, minutes=1)]
    asyncio.run(agent.board.refresh())
    seen = agent.status.newest_snapshot
    assert seen is not None and seen.id == doomed[0].id
    listed = store.ids

    def ids_mid_prune() -> list[str]:
        out = listed()
        if (store.root / doomed[-1].id).exists():
            store.delete(doomed[-1].id)  # what a prune in a worker thread does meanwhile
        return out

    monkeypatch.setattr(store, "ids", ids_mid_prune)
    with pytest.raises(FileNotFoundError):
        store.entries()  # what a scrape used to run into
    doomed.append(publish(store, minutes=2))
    asyncio.run(agent.board.refresh())
    text, io = _scrape_recording_io(agent.registry)
    assert io == [] and 'pitstop_snapshot_present{kind="full"} 1.0' in text
    assert agent.status.newest_snapshot == seen  # the last answer, until the next read
