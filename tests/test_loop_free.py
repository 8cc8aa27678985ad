"""The status file, the canary's record and the vLLM version it is keyed by: off the loop.

The loop runs the front, the health probes and the watchdog's heartbeat: a step that blocks
it for a second stalls all of them. A ticker on the loop shows whether it was free.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines.probe import EngineProbe
from agent.engines.vllm.adapter import VllmAdapter
from agent.supervisor.canary import CanaryBook, CanaryCheck
from agent.supervisor.ladder import Prepared
from agent.systemd import Notifier
from agent.wiring import Agent
from tests.agentproc import agent_config
from tests.loopkit import slow_disk, ticks_while
from tests.refengine_proc import Engine
from tests.vllm_paths_kit import vllm_python
from tests.vllmproc import CPU_ARGS

# How long each fsync or rename waits on the slow disk, and the engine's interpreter before
# it answers what it has installed.
DISK_S = 0.4
PROBE_S = 2.0


def _reason_on_disk(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("reason")
    except (OSError, ValueError):
        return None


def test_a_state_change_on_a_slow_disk_leaves_the_event_loop_running(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(agent_config(tmp_path, tiny_model, snapshots={"enabled": False},
                                    front={"enabled": False}, metrics={"enabled": False}),
                       "test")

    async def change_and_see_it_written() -> None:
        agent = Agent.start(cfg, None, Notifier({}))
        slow_disk(monkeypatch, 1.0)
        agent.status.reason = "on a slow disk"
        agent._changed()  # what every state change of the supervisor calls
        while _reason_on_disk(agent.status_file.path) != "on a slow disk":
            await asyncio.sleep(0.01)

    t0 = time.monotonic()
    _, ticks = asyncio.run(ticks_while(change_and_see_it_written()))
    took = time.monotonic() - t0
    assert took >= 1.0
    assert ticks.count >= 10 and ticks.longest_s < 0.5, (ticks, took)


def test_recording_and_checking_the_canary_leave_the_event_loop_running(
        refengine: Engine, tmp_path: Path, tiny_model: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's version, part of the canary record's key, is read by running the engine's
    # interpreter; this one takes PROBE_S to start. A package directory on its path that
    # changes makes the next read run it again.
    site = tmp_path / "site"
    site.mkdir()
    slow = tmp_path / "python"
    slow.write_text(f'#!/bin/sh\nsleep {PROBE_S}\nexec {vllm_python()} "$@"\n')
    slow.chmod(0o755)
    cfg = parse_config({
        "engine": {"kind": "vllm", "model": str(tiny_model), "served_model_name": refengine.name,
                   "python": str(slow), "socket": str(refengine.socket), "args": CPU_ARGS,
                   "env": {"PYTHONPATH": str(site)}},
        "paths": {"state_dir": str(tmp_path / "state")}}, "test")
    book = CanaryBook(tmp_path / "canary.json")
    check = CanaryCheck(book, VllmAdapter(cfg))
    # The record is written with its fsyncs, on a disk a dump is filling.
    slow_disk(monkeypatch, DISK_S)

    async def verify_twice() -> None:
        async with EngineProbe(refengine.socket, timeout=60) as probe:
            # First: nothing recorded yet, so the answer is recorded.
            await check.verify(cfg, probe, Prepared("cold", None).canary)
            assert book.load() is not None
            (site / "new_package.py").write_text("")
            # Then checked against the record, whose key is read again.
            await check.verify(cfg, probe, Prepared("cold", None).canary)

    t0 = time.monotonic()
    _, ticks = asyncio.run(ticks_while(verify_twice()))
    took = time.monotonic() - t0
    assert took >= 2 * PROBE_S
    assert ticks.longest_s < PROBE_S / 2, (ticks, took)
    assert os.path.getsize(book.path) > 0
