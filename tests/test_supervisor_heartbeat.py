"""A long step off the loop keeps the supervisor's heartbeat (what systemd's watchdog reads)
fresh; a step stuck past its limit does not."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.errors import StartPathError
from agent.metrics import Metrics, StatusView, new_registry
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.canary import CanaryBook
from agent.supervisor.engine import EngineProcess
from agent.supervisor.gate import EngineGate
from agent.supervisor.ladder import Attempt, Prepared
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
    stalest = asyncio.run(_stalest_during_the_long_step(tiny_model, start_timeout_s=300))
    assert stalest < BEAT_S + 0.5, stalest


def test_a_step_stuck_past_its_limit_lets_the_heartbeat_go_stale(tiny_model: Path):
    stalest = asyncio.run(_stalest_during_the_long_step(tiny_model, start_timeout_s=1))
    assert stalest > STEP_S - 1 - 0.5, stalest


def test_a_rung_whose_start_may_outlast_the_start_timeout_keeps_the_heartbeat_fresh(
        tiny_model: Path):
    # A refill of 64 GiB from a slow disk may take minutes longer than health.start_timeout_s:
    # the rung's own limit counts, not the start timeout.
    rung = SlowRung(limit_s=STEP_S + 30)
    stalest = asyncio.run(_stalest_during_the_long_step(tiny_model, start_timeout_s=1, rung=rung))
    assert rung.started and stalest < BEAT_S + 0.5, stalest


def test_a_rung_stuck_past_its_own_limit_lets_the_heartbeat_go_stale(tiny_model: Path):
    rung = SlowRung(limit_s=1)
    stalest = asyncio.run(_stalest_during_the_long_step(tiny_model, start_timeout_s=1, rung=rung))
    assert rung.started and stalest > STEP_S - 1 - 0.5, stalest


class SlowRung:
    """A rung whose start takes STEP_S (a refill, say) and then falls through."""

    name = "refill"
    reuses_held_memory = False

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.started = False
        self.running = asyncio.Event()
        self.done = asyncio.Event()

    async def prepare(self, attempt: Attempt) -> Prepared[None]:
        return Prepared(self.name, None)

    async def start(self, attempt: Attempt, prepared: Prepared[None]) -> EngineProcess:
        self.started = True
        self.running.set()
        await asyncio.sleep(STEP_S)  # the holder loads in its own process
        self.done.set()
        raise StartPathError(Refusal(RefusalCode.REFILL_FAILED, "a test rung"))

    def start_limit_s(self, prepared: Prepared[None]) -> float:
        return self.limit_s

    async def after_verified(self, engine: EngineProcess, prepared: Prepared[None]) -> None:
        return None

    async def failed(self, prepared: Prepared[None], reason: str) -> None:
        return None


async def _stalest_during_the_long_step(tiny_model: Path, start_timeout_s: float,
                                   rung: SlowRung | None = None) -> float:
    d = socket_dir()
    raw = agent_config(d, tiny_model)
    raw.setdefault("health", {})["start_timeout_s"] = start_timeout_s
    cfg = parse_config(raw, "test")
    adapter = build_adapter(cfg)
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    hashing = asyncio.Event()
    done = asyncio.Event()

    async def before_start() -> None:
        if rung is not None:
            return  # the rung's start is the long step
        hashing.set()
        await asyncio.sleep(STEP_S)  # the digest is computed in a worker thread
        done.set()

    # The long step: the rung's start when there is one, else the identity's digest.
    begun, ended = (rung.running, rung.done) if rung is not None else (hashing, done)

    sup = Supervisor(
        config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=AgentStatus(), canaries=CanaryBook(d / "canary.json"),
        paths=[*([rung] if rung else []), ColdStart(adapter)], before_start=before_start)
    run = asyncio.ensure_future(sup.run())
    stalest = 0.0
    try:
        await asyncio.wait_for(begun.wait(), 30)
        while not ended.is_set():
            stalest = max(stalest, time.monotonic() - sup.heartbeat)
            await asyncio.sleep(0.05)
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
    return stalest
