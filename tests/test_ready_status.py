"""READY=1 follows the status file: whoever `systemctl start` or `restart` returned to reads
the recovery that made the engine ready, not the file of the agent before."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agent.config import parse_config
from agent.systemd import Notifier
from tests.agentproc import agent_config


class StatusAtReady(Notifier):
    """Reads status.json from disk the moment READY=1 would be sent, as systemctl's caller
    would, then asks the agent to stop."""

    def __init__(self, status_path: Path) -> None:
        super().__init__({})
        self.status_path = status_path
        self.seen: list[dict] = []
        self.on_ready = lambda: None
        self.engine_pid: int | None = None

    def ready(self, status: str = "") -> None:
        self.seen.append(json.loads(self.status_path.read_text()))
        self.on_ready()


def test_the_status_file_has_the_recovery_when_ready_is_sent(tmp_path: Path,
                                                              tiny_model: Path) -> None:
    from agent.wiring import Agent

    cfg = parse_config(agent_config(tmp_path, tiny_model, holder={"enabled": False},
                                    snapshots={"enabled": False}), "test")
    notifier = StatusAtReady(cfg.paths.run / "status.json")
    agent = Agent.start(cfg, None, notifier)

    def stop() -> None:
        notifier.engine_pid = agent.status.engine_pid
        agent.supervisor.request_stop()

    notifier.on_ready = stop
    assert asyncio.run(asyncio.wait_for(agent.run(), 180)) == 0

    [at_ready] = notifier.seen
    assert at_ready["state"] == "ready", at_ready
    assert at_ready["last_recovery"]["path"] == "cold", at_ready
    assert at_ready["last_recovery"]["result"] == "success"
    assert at_ready["engine_pid"] == notifier.engine_pid is not None
