"""The front never forwards vLLM's development endpoints: with the Pitstop plugin the engine
runs with VLLM_SERVER_DEV_MODE=1, and /collective_rpc from a client would detach its weights."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.engines.vllm.adapter import DEV_ENDPOINTS
from tests.frontkit import front_on, socket_dir


@dataclass
class Recorder:
    """An engine that answers 200 to everything and remembers what reached it."""

    sock: Path
    seen: list[str]


async def _recorder() -> tuple[Recorder, web.AppRunner]:
    rec = Recorder(socket_dir() / "engine.sock", [])

    async def any_path(request: web.Request) -> web.Response:
        rec.seen.append(request.path)
        return web.json_response({"results": [{}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(rec.sock)).start()
    return rec, runner


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_no_dev_endpoint_reaches_the_engine_through_the_front(method: str):
    async def go() -> None:
        rec, runner = await _recorder()
        try:
            async with front_on(rec) as h, aiohttp.ClientSession() as s:  # type: ignore[arg-type]
                base = f"http://127.0.0.1:{h.front.port}"
                for path in DEV_ENDPOINTS:
                    async with s.request(method, base + path,
                                         json={"method": "pitstop_detach"}) as r:
                        assert r.status == 404, (path, r.status)
                assert rec.seen == []
                # The front does forward the API itself: the recorder is reachable.
                async with s.post(base + "/v1/models", json={}) as r:
                    assert r.status == 200
                assert rec.seen == ["/v1/models"]
        finally:
            await runner.cleanup()

    asyncio.run(go())
