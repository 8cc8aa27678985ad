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
from agent.front.auth import ApiKeys
from agent.front.proxy import Front
from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from agent.supervisor.gate import EngineGate
from agent.tls import LiveTls

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


class CutRelay:
    """A Unix socket between the front and the engine that passes bytes both ways, except
    that the first answer stops reaching the front right after its `events`-th SSE event:
    the test then kills the engine at a token it chose, not wherever a kill happens to land.

    Example::

        relay = CutRelay(engine.sock, d / "relay.sock", events=4)
        await relay.start()
        gate.open(relay.sock)            # the front talks to the engine through it
        await relay.reached.wait()       # 4 events are at the front, no more
    """

    def __init__(self, engine_sock: Path, sock: Path, events: int) -> None:
        self.engine_sock, self.sock, self.events = engine_sock, sock, events
        self.reached = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._connections = 0

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.sock))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, front_r: asyncio.StreamReader, front_w: asyncio.StreamWriter) -> None:
        self._connections += 1
        limit = self.events if self._connections == 1 else None
        try:
            engine_r, engine_w = await asyncio.open_unix_connection(str(self.engine_sock))
        except OSError:
            front_w.close()
            return
        ask = asyncio.create_task(self._pump(front_r, engine_w))
        try:
            await self._answer(engine_r, front_w, limit)
        finally:
            ask.cancel()
            engine_w.close()
            front_w.close()

    @staticmethod
    async def _pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()

    async def _answer(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                      limit: int | None) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            if limit is not None:
                for _ in range(limit):
                    w.write(await r.readuntil(b"\n\n"))
                tail = await r.readexactly(2)
                if tail == b"\r\n":  # the end of the HTTP chunk: the last event is whole
                    w.write(tail)
                await w.drain()
                self.reached.set()
                while await r.read(65536):
                    pass  # past the cut: nothing more reaches the front
                return
            while data := await r.read(65536):
                w.write(data)
                await w.drain()


@dataclass
class Harness:
    """A front on the real EngineGate, driven by the test as the supervisor would."""

    engine: Engine
    gate: EngineGate
    front: Front
    metrics: Metrics

    @property
    def base_url(self) -> str:
        scheme = "https" if self.front.tls else "http"
        return f"{scheme}://127.0.0.1:{self.front.port}/v1"

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
            if f.queue_depth == 0 and not f._active and self.gate.inflight == 0:
                return
            await asyncio.sleep(0.02)
        f = self.front
        raise AssertionError(f"front not settled: queue {f.queue_depth}, handlers "
                             f"{len(f._active)}, gate {self.gate.inflight}")


@contextlib.asynccontextmanager
async def front_on(engine: Engine, keys: ApiKeys | None = None, tls: LiveTls | None = None,
                   **config: Any) -> AsyncIterator[Harness]:
    gate = EngineGate()
    holder: list[Front] = []
    metrics = Metrics(new_registry(), lambda: StatusView(
        "running", gate.current is not None, None, (), NodeInfo(),
        front_queue_depth=holder[0].queue_depth if holder else 0,
        front_inflight=gate.inflight))
    front = Front(FrontConfig(port=0, **config), gate, metrics, keys=keys, tls=tls)
    holder.append(front)
    await front.start()
    gate.open(engine.sock)
    try:
        yield Harness(engine, gate, front, metrics)
    finally:
        await front.stop(drain_timeout=2.0)


def socket_dir() -> Path:
    """A short directory for Unix sockets (sun_path holds 108 bytes), removed when this
    process exits."""
    import atexit
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="pitstop-front-", dir=os.environ.get("TMPDIR", "/tmp"))
    atexit.register(shutil.rmtree, d, True)
    return Path(d)
