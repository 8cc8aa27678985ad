"""Quiet before a snapshot, with the real front and reference engine: no connection is left."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp
import pytest

from agent.checkpoint.connections import Outside, refuse_outside_connections, survey
from agent.checkpoint.snapshotter import tree_pids
from tests.frontkit import MODEL_NAME, Engine, front_on, socket_dir

pytestmark = pytest.mark.integration


async def _ask(s: aiohttp.ClientSession, url: str, stream: bool) -> bytes:
    async with s.post(url + "/completions", json={
            "model": MODEL_NAME, "prompt": "Quiet", "max_tokens": 4, "temperature": 0,
            "stream": stream}) as r:
        assert r.status == 200
        return await r.read()


def test_quiesce_closes_the_fronts_pooled_connections_and_the_next_request_opens_one(
        tiny_model: Path):
    d = socket_dir()
    engine = Engine(tiny_model, d / "engine.sock", d / "engine.log")
    engine.start()

    async def scenario() -> None:
        await engine.wait_ready()
        assert engine.proc is not None
        tree = tree_pids(engine.proc.pid)
        async with front_on(engine) as h, aiohttp.ClientSession() as s:
            await _ask(s, h.base_url, stream=False)
            await _ask(s, h.base_url, stream=True)
            await h.settled()
            # The whole answer's keep-alive connection stays in the front's pool.
            pooled = survey(tree).outside
            assert [c.reason for c in pooled] == [Outside.UNIX_PEER], pooled
            h.gate.pause_admission()
            held = asyncio.ensure_future(_ask(s, h.base_url, stream=False))
            assert await h.gate.quiesce(5.0)
            loop = asyncio.get_running_loop()
            left = await loop.run_in_executor(None, refuse_outside_connections, tree)
            assert left.outside == ()
            assert not held.done()  # held by the front while paused
            h.gate.resume_admission()
            await held
            assert len(survey(tree).outside) == 1  # a new pool for the next requests

    try:
        asyncio.run(scenario())
    finally:
        engine.kill()
        shutil.rmtree(d, ignore_errors=True)


def test_quiesce_waits_for_a_request_in_flight_and_says_so_when_it_runs_too_long(
        tiny_model: Path):
    d = socket_dir()
    engine = Engine(tiny_model, d / "engine.sock", d / "engine.log")
    engine.start()

    async def scenario() -> None:
        await engine.wait_ready()
        async with front_on(engine) as h, aiohttp.ClientSession() as s:
            long = asyncio.ensure_future(s.post(h.base_url + "/completions", json={
                "model": MODEL_NAME, "prompt": "Long", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True}))
            while h.gate.inflight == 0:
                await asyncio.sleep(0.01)
            h.gate.pause_admission()
            assert not await h.gate.quiesce(0.05)  # still running: nothing was closed
            assert await h.gate.quiesce(120)
            r = await long
            assert r.status == 200
            r.release()
            h.gate.resume_admission()

    try:
        asyncio.run(scenario())
    finally:
        engine.kill()
        shutil.rmtree(d, ignore_errors=True)
