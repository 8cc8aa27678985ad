"""An identity that cannot be read at a start is a failed start, retried: never an agent exit."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.errors import IdentityError
from agent.metrics import Metrics, StatusView, new_registry
from agent.supervisor.canary import CanaryBook
from agent.supervisor.gate import EngineGate
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.frontkit import socket_dir

pytestmark = pytest.mark.integration


def test_a_failed_identity_read_fails_that_start_and_the_next_one_serves(
        tiny_model: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="pitstop.supervisor")
    asyncio.run(_fails_then_serves(tiny_model))
    assert "on start_failed: cannot read what the engine depends on" in caplog.text
    assert "changed while it was hashed" in caplog.text


async def _fails_then_serves(tiny_model: Path) -> None:
    d = socket_dir()
    cfg = parse_config(agent_config(d, tiny_model), "test")
    adapter = build_adapter(cfg)
    status = AgentStatus()
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    reads = []

    async def before_start() -> None:
        reads.append(1)
        if len(reads) == 1:
            raise IdentityError(f"{tiny_model}/model.safetensors changed while it was hashed")

    sup = Supervisor(
        config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=status, canaries=CanaryBook(d / "canary.json"), paths=[ColdStart(adapter)],
        before_start=before_start)
    run = asyncio.ensure_future(sup.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while status.state != "ready":
            assert not run.done(), f"the supervisor ended: {run.exception()!r}"
            assert loop.time() < deadline, f"not ready: {status}"
            await asyncio.sleep(0.05)
        assert len(reads) == 2  # the failed start, then the one that served
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
