"""What an engine prints reaches the agent's log, line by line, without the agent's own
passing health checks (one a second would bury everything else in the journal)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.engines.base import LaunchSpec
from agent.supervisor.engine import EngineProcess

# What uvicorn (vLLM's server) prints for requests on a Unix socket, client "-".
LINES = [
    "INFO:     Application startup complete.",
    'INFO:      - "GET /health HTTP/1.1" 200 OK',
    'INFO:      - "POST /v1/completions HTTP/1.1" 200 OK',
    'INFO:      - "GET /health HTTP/1.1" 503 Service Unavailable',
    'INFO:      - "GET /healthz HTTP/1.1" 404 Not Found',
    "ERROR engine core died",
]


def _forwarded(health_path: str | None, caplog: pytest.LogCaptureFixture) -> list[str]:
    script = "".join(f"echo '{line}'\n" for line in LINES)

    async def main() -> None:
        eng = EngineProcess.spawn(LaunchSpec(argv=["sh", "-c", script]), health_path)
        await eng.wait()
        await eng.close()

    with caplog.at_level(logging.INFO, logger="pitstop.engine"):
        asyncio.run(main())
    return [r.getMessage().split("] ", 1)[1] for r in caplog.records
            if r.name == "pitstop.engine"]


def test_passing_health_checks_are_left_out_and_everything_else_kept(
        caplog: pytest.LogCaptureFixture):
    assert _forwarded("/health", caplog) == [line for line in LINES if line != LINES[1]]


def test_without_a_health_path_every_line_is_kept(caplog: pytest.LogCaptureFixture):
    assert _forwarded(None, caplog) == LINES
