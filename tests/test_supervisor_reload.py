"""A reload reaches the serving loop at once: the next health check uses the new settings."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from agent.reload import plan
from agent.supervisor.canary import CanaryBook
from agent.supervisor.gate import EngineGate
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.frontkit import socket_dir

pytestmark = pytest.mark.integration


def test_reloaded_health_settings_are_used_by_the_serving_engines_next_check(
        tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pitstop.supervisor")
    asyncio.run(_reload_then_hang(tiny_model))
    # With the settings the engine started under, a hang would take 3 failed checks.
    assert "health check 1/1 failed" in caplog.text
    assert "failed 1 health checks in a row" in caplog.text


async def _wait(pred, what: str, timeout: float = 120) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _reload_then_hang(tiny_model: Path) -> None:
    d = socket_dir()
    data = agent_config(d, tiny_model, health={"failures_before_restart": 3, "interval_s": 0.5,
                                               "timeout_s": 1.0})
    old = parse_config(data, "test")
    adapter = build_adapter(old)
    status = AgentStatus()
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), NodeInfo()))
    sup = Supervisor(
        config=old, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=status, canaries=CanaryBook(d / "canary.json"), paths=[ColdStart(adapter)])
    run = asyncio.ensure_future(sup.run())
    try:
        await _wait(lambda: status.state == "ready", "ready")
        pid = status.engine_pid
        assert pid is not None
        data["health"]["failures_before_restart"] = 1
        effective, result = plan(old, parse_config(data, "test"), "test")
        assert result.applied == ("health.failures_before_restart",)
        sup.apply_config(effective, restart_engine=result.engine_restart)
        await asyncio.sleep(1.0)  # the serving loop has taken the reload by now
        os.kill(pid, signal.SIGSTOP)
        await _wait(lambda: status.restarts == 1, "the hang to be detected", 30)
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
