"""A rung that serves beside a dead engine's tree is tried while that tree is torn down;
every other rung waits for it. The real supervisor and reference engine; the standby is a
stand-in (a cold start under its name), and the teardown is held open by the test."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.metrics import Metrics, StatusView, new_registry
from agent.supervisor.canary import CanaryBook
from agent.supervisor.engine import EngineProcess
from agent.supervisor.gate import EngineGate
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.cold import ColdStart, ExtraArgs
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.frontkit import socket_dir

pytestmark = pytest.mark.integration

# How long the test holds a dead tree's teardown open: a walk that waits for it waits this.
HELD_S = 5.0


class StandInStandby(ColdStart):
    """Named as the standby rung; says whether it serves beside a dead tree as told, and
    records, when it starts, whether the dead tree's teardown had ended."""

    name = "standby"

    def __init__(self, adapter, apart: bool, torn_down: threading.Event) -> None:
        super().__init__(adapter)
        self.apart = apart
        self._torn_down = torn_down
        self.started_after_teardown: list[bool] = []

    def serves_beside_dead(self) -> bool:
        return self.apart

    async def start(self, attempt: Attempt, prepared: Prepared[ExtraArgs]) -> EngineProcess:
        self.started_after_teardown.append(self._torn_down.is_set())
        return await super().start(attempt, prepared)


@asynccontextmanager
async def supervisor(tiny_model: Path, apart: bool, torn_down: threading.Event
                     ) -> AsyncIterator[tuple[Supervisor, AgentStatus, StandInStandby]]:
    d = socket_dir()
    cfg = parse_config(agent_config(d, tiny_model), "test")
    adapter = build_adapter(cfg)
    status = AgentStatus()
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    standby = StandInStandby(adapter, apart, torn_down)
    sup = Supervisor(
        config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=status, canaries=CanaryBook(d / "canary.json"),
        paths=[standby, ColdStart(adapter)], beside=standby)
    run = asyncio.ensure_future(sup.run())
    try:
        yield sup, status, standby
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
        shutil.rmtree(d, ignore_errors=True)


async def _wait(status: AgentStatus, restarts: int) -> AgentStatus:
    for _ in range(1200):
        if status.state == "ready" and status.restarts == restarts:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"not ready after {restarts} restarts: {status}")


def _hold_teardowns(monkeypatch: pytest.MonkeyPatch, torn_down: threading.Event) -> None:
    """Each kill of an engine's tree kills it, then is held open HELD_S before it returns
    (a tree whose processes take that long to go), and says when it ended."""
    real_kill = EngineProcess.kill

    async def kill(self: EngineProcess):
        exit = await real_kill(self)
        await asyncio.sleep(HELD_S)
        torn_down.set()
        return exit

    monkeypatch.setattr(EngineProcess, "kill", kill)


@pytest.mark.parametrize(("apart", "started_after_teardown"), [
    (True, [False]),   # the standby serves while the dead tree goes
    (False, [True]),   # no room beside it: the standby waits for the tree, as every rung
])
def test_the_standby_is_tried_while_a_dead_tree_goes_only_when_it_stands_apart(
        tiny_model, monkeypatch, apart, started_after_teardown):
    torn_down = threading.Event()
    _hold_teardowns(monkeypatch, torn_down)

    async def main() -> None:
        async with supervisor(tiny_model, apart, torn_down) as (sup, status, standby):
            await _wait(status, 0)
            standby.started_after_teardown.clear()
            assert status.engine_pid is not None
            os.kill(status.engine_pid, signal.SIGKILL)
            rec = (await _wait(status, 1)).last_recovery
            assert rec.path == "standby", rec
            assert standby.started_after_teardown == started_after_teardown
            # What the agent waited for before its decision: the held teardown, or not.
            assert (rec.lead_s["teardown"] >= HELD_S) is (not apart), rec.lead_s

    asyncio.run(main())


def test_rungs_after_a_standby_that_failed_wait_for_the_dead_tree(tiny_model, monkeypatch):
    torn_down = threading.Event()
    _hold_teardowns(monkeypatch, torn_down)
    cold_started_after_teardown: list[bool] = []
    real_start = ColdStart.start

    async def start(self: ColdStart, attempt: Attempt, prepared: Prepared[ExtraArgs]):
        if self.name == "cold":
            cold_started_after_teardown.append(torn_down.is_set())
        return await real_start(self, attempt, prepared)

    monkeypatch.setattr(ColdStart, "start", start)

    async def main() -> None:
        async with supervisor(tiny_model, True, torn_down) as (sup, status, standby):
            await _wait(status, 0)
            cold_started_after_teardown.clear()

            async def refuse(attempt: Attempt):
                from agent.refusal import Refusal, RefusalCode
                return Refusal(RefusalCode.STANDBY_NOT_ARMED, "a stand-in that refuses")

            standby.prepare = refuse  # type: ignore[method-assign]
            assert status.engine_pid is not None
            os.kill(status.engine_pid, signal.SIGKILL)
            rec = (await _wait(status, 1)).last_recovery
            assert rec.path == "cold", rec
            # The cold start needs the dead tree's PIDs and memory back: it waited.
            assert cold_started_after_teardown == [True]

    asyncio.run(main())
