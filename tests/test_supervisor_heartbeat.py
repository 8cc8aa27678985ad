"""A long step off the loop keeps the supervisor's heartbeat (what systemd's watchdog reads)
fresh; a step stuck past its limit does not."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.metrics import Metrics, StatusView, new_registry
from agent.supervisor.canary import CanaryBook
from agent.supervisor.gate import EngineGate
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import BEAT_S, Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.frontkit import socket_dir

pytestmark = pytest.mark.integration

STEP_S = 3.0


def test_hashing_the_weights_for_longer_than_the_watchdog_allows_keeps_the_heartbeat_fresh(
        tiny_model: Path):
    # WatchdogSec=30s lets the loop be silent for 23 s with the default health settings;
    # a 64 GiB model takes longer than that to hash at its first start.
    stalest = asyncio.run(_stalest_during_identity(tiny_model, start_timeout_s=300))
    assert stalest < BEAT_S + 0.5, stalest


def test_a_step_stuck_past_its_limit_lets_the_heartbeat_go_stale(tiny_model: Path):
    stalest = asyncio.run(_stalest_during_identity(tiny_model, start_timeout_s=1))
    assert stalest > STEP_S - 1 - 0.5, stalest


async def _stalest_during_identity(tiny_model: Path, start_timeout_s: float) -> float:
    d = socket_dir()
    raw = agent_config(d, tiny_model)
    raw.setdefault("health", {})["start_timeout_s"] = start_timeout_s
    cfg = parse_config(raw, "test")
    adapter = build_adapter(cfg)
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    hashing = asyncio.Event()
    done = asyncio.Event()

    async def before_start() -> None:
        hashing.set()
        await asyncio.sleep(STEP_S)  # the digest is computed in a worker thread
        done.set()

    sup = Supervisor(
        config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=AgentStatus(), canaries=CanaryBook(d / "canary.json"),
        paths=[ColdStart(adapter)], before_start=before_start)
    run = asyncio.ensure_future(sup.run())
    stalest = 0.0
    try:
        await asyncio.wait_for(hashing.wait(), 30)
        while not done.is_set():
            stalest = max(stalest, time.monotonic() - sup.heartbeat)
            await asyncio.sleep(0.05)
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
    return stalest
