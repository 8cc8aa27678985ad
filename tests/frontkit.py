"""Real parts for the front's tests: the reference engine as a process, and a front on it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.config import FrontConfig
from agent.front.proxy import Front
from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from agent.supervisor.gate import EngineGate

MODEL_NAME = "tiny"


class Engine:
    """`python -m agent.engines.refengine` on a Unix socket; killed for real, restarted."""

    def __init__(self, model: Path, sock: Path, log: Path, *extra: str) -> None:
        self.model, self.sock, self.log, self.extra = model, sock, log, extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.engines.refengine", "--model", str(self.model),
                 "--uds", str(self.sock), "--served-model-name", MODEL_NAME, "--device", "cpu",
                 *self.extra], stdout=log, stderr=log)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited {self.proc.returncode}: "
                                     f"{self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError, aiohttp.ClientError):
                async with aiohttp.ClientSession(
                        connector=aiohttp.UnixConnector(path=str(self.sock))) as s, \
                        s.get("http://engine/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise AssertionError(f"engine not ready in {timeout} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: the crash the front must hide."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    async def direct(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming request straight to the engine's socket: the reference answer."""
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(self.sock))) as s, \
                s.post("http://engine" + path, json={**body, "stream": False}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


@dataclass
class Harness:
    """A front on the real EngineGate, driven by the test as the supervisor would."""

    engine: Engine
    gate: EngineGate
    front: Front
    metrics: Metrics

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.front.port}/v1"

    async def restart(self, close_gate: bool = True) -> None:
        """Kill the engine, start a new one on the same socket, open the gate again."""
        self.engine.kill()
        if close_gate:
            self.gate.close("engine killed by the test")
        self.engine.start()
        await self.engine.wait_ready()
        self.gate.open(self.engine.sock)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def settled(self, timeout: float = 10.0) -> None:
        """Wait until the front holds nothing: no queue, no engine request, no handler."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            f = self.front
            if f.queue_depth == 0 and f.inflight == 0 and not f._active and \
                    self.gate.inflight == 0:
                return
            await asyncio.sleep(0.02)
        f = self.front
        raise AssertionError(f"front not settled: queue {f.queue_depth}, inflight {f.inflight}"
                             f", handlers {len(f._active)}, gate {self.gate.inflight}")


@contextlib.asynccontextmanager
async def front_on(engine: Engine, **config: Any) -> AsyncIterator[Harness]:
    gate = EngineGate()
    holder: list[Front] = []
    metrics = Metrics(new_registry(), lambda: StatusView(
        "running", gate.current is not None, None, (), NodeInfo(),
        front_queue_depth=holder[0].queue_depth if holder else 0,
        front_inflight=holder[0].inflight if holder else 0))
    front = Front(FrontConfig(port=0, **config), gate, metrics)
    holder.append(front)
    await front.start()
    gate.open(engine.sock)
    try:
        yield Harness(engine, gate, front, metrics)
    finally:
        await front.stop(drain_timeout=2.0)


def socket_dir() -> Path:
    """A short directory for Unix sockets (sun_path holds 108 bytes)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="pitstop-front-", dir=os.environ.get("TMPDIR", "/tmp")))
