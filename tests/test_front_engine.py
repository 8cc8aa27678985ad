"""The front with the real reference engine: SIGKILL it mid-answer and clients never know."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.front.relay import Relay
from agent.front.resume import Plan, Tracker
from agent.front.sse import SSEParser
from tests.frontkit import MODEL_NAME, CutRelay, Engine, Harness, front_on, socket_dir
from tests.prereq import require

pytestmark = pytest.mark.integration

try:
    import openai
except ImportError:  # pragma: no cover - a dev dependency; require() says so
    openai = None  # type: ignore[assignment]

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_OPENAI_KEYS = ("model", "prompt", "messages", "max_tokens", "temperature", "stop", "seed")


@pytest.fixture(scope="module")
def engine_proc(tiny_model: Path) -> Any:
    d = socket_dir()
    e = Engine(tiny_model, d / "engine.sock", d / "engine.log", "--kv-slots", "16")
    try:
        yield e
    finally:
        e.kill()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engine(engine_proc: Engine) -> Engine:
    """The module's engine, started again if the last test left it killed (most do)."""
    require(openai is not None, "the openai package is missing: run `make venv`")
    if engine_proc.proc is None or engine_proc.proc.poll() is not None:
        engine_proc.start()
    return engine_proc


def spec(i: int, max_tokens: int, **more: Any) -> tuple[str, dict[str, Any]]:
    """Request i: completions and chat alternately, greedy, running to max_tokens."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **more}
    if i % 2:
        return CHAT, {**body, "messages": [{"role": "user", "content": f"Tell story {i}"}]}
    return COMPLETIONS, {**body, "prompt": f"Story number {i}: once upon a time"}


def text_of(path: str, answer: dict[str, Any]) -> str:
    c = answer["choices"][0]
    return c["message"]["content"] if path == CHAT else c["text"]


async def references(engine: Engine, specs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """What an uninterrupted run answers, straight from the engine's socket."""
    answers = await asyncio.gather(*(engine.direct(p, b) for p, b in specs))
    return [text_of(p, a) for (p, _), a in zip(specs, answers, strict=True)]


def add_stops(specs: list[tuple[str, dict[str, Any]]], refs: list[str], every: int) -> None:
    """Give every `every`-th request a stop string from the middle of its own answer."""
    for i in range(0, len(specs), every):
        text = refs[i]
        for at in range(len(text) // 2, len(text) - 2):
            window = text[at:at + 2]
            if window.isascii() and window.isalnum():
                specs[i][1]["stop"] = [window, "@@@@"]
                break


def client(h: Harness) -> Any:
    # max_retries=0: the openai client's own retries would hide a failure of the front.
    return openai.AsyncOpenAI(base_url=h.base_url, api_key="none", max_retries=0, timeout=300)


async def through_front(c: Any, path: str, body: dict[str, Any], stream: bool,
                        progress: list[int] | None = None, i: int = 0) -> str:
    kw = {k: v for k, v in body.items() if k in _OPENAI_KEYS}
    extra = {k: v for k, v in body.items() if k not in _OPENAI_KEYS}
    api = c.chat.completions if path == CHAT else c.completions
    if not stream:
        r = await api.create(stream=False, extra_body=extra, **kw)
        return r.choices[0].message.content if path == CHAT else r.choices[0].text
    parts: list[str] = []
    async for chunk in await api.create(stream=True, extra_body=extra, **kw):
        for ch in chunk.choices:
            parts.append((ch.delta.content or "") if path == CHAT else ch.text)
        if progress is not None:
            progress[i] += 1
    return "".join(parts)


async def stream_started(s: aiohttp.ClientSession, h: Harness, path: str,
                         body: dict[str, Any], events: int = 5) -> Any:
    """A streaming request through the front, once its first `events` events arrived."""
    r = await s.post(h.base_url[:-3] + path, json={**body, "stream": True})
    got = b""
    while got.count(b"\n\n") < events:
        got += await r.content.readany()
    return r


async def until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_sixteen_streams_survive_sigkill(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        specs = [spec(i, 100) for i in range(16)]
        add_stops(specs, await references(engine, specs), every=3)
        want = await references(engine, specs)
        async with front_on(engine) as h:
            c = client(h)
            progress = [0] * 16
            tasks = [asyncio.create_task(through_front(c, p, b, True, progress, i))
                     for i, (p, b) in enumerate(specs)]
            await until(lambda: all(t.done() or progress[i] >= 5
                                    for i, t in enumerate(tasks)), what="every stream under way")
            cut = [not t.done() for t in tasks]
            await h.restart()
            got = await asyncio.gather(*tasks)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g == w, f"request {i} ({specs[i][0]}, stop {specs[i][1].get('stop')})"
            resumed = sum(h.sample("pitstop_front_resumed_requests_total", endpoint=p)
                          for p in (COMPLETIONS, CHAT))
            # A client still reading its last bytes at the kill was not cut: at most sum(cut).
            assert 8 <= resumed <= sum(cut)
            assert h.sample("pitstop_front_stall_seconds_count") == resumed
            assert not any(k for k in _failures(h))
            await h.settled()
    asyncio.run(main())


def _failures(h: Harness) -> list[str]:
    reasons = ("deadline", "queue_full", "draining", "resume_limit", "not_resumable",
               "engine_lost", "engine_error", "client_gone")
    return [r for r in reasons
            if h.sample("pitstop_front_failed_requests_total", reason=r)]


def test_sixteen_whole_requests_are_sent_again(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        specs = [spec(i, 100) for i in range(16)]
        add_stops(specs, await references(engine, specs), every=4)
        want = await references(engine, specs)
        async with front_on(engine) as h:
            c = client(h)
            tasks = [asyncio.create_task(through_front(c, p, b, False)) for p, b in specs]
            await until(lambda: h.gate.inflight == 16, what="16 requests at the engine")
            await asyncio.sleep(0.1)
            at_kill = h.gate.inflight
            await h.restart()
            assert await asyncio.gather(*tasks) == want
            resumed = sum(h.sample("pitstop_front_resumed_requests_total", endpoint=p)
                          for p in (COMPLETIONS, CHAT))
            assert 8 <= resumed <= at_kill
            assert h.sample("pitstop_front_requests_total", endpoint=CHAT, code="200") == 8
            assert not _failures(h)
            await h.settled()
    asyncio.run(main())


def test_the_first_token_after_a_recovery_is_timed_apart_from_steady_state(
        engine: Engine) -> None:
    def ttft(path: str, phase: str, what: str = "count") -> float:
        return h.sample(f"pitstop_front_time_to_first_token_seconds_{what}", path=path,
                        phase=phase)

    async def main() -> None:
        nonlocal h
        await engine.wait_ready()
        p, body = spec(0, 8)
        async with front_on(engine) as h:
            c = client(h)
            # The supervisor opens the gate once per recovery, naming the rung it took.
            h.gate.close("a recovery, as the test tells it")
            h.gate.open(engine.sock, "hybrid")
            await through_front(c, p, body, stream=False)  # a whole answer has no first token
            for _ in range(3):
                await through_front(c, p, body, stream=True)
            h.gate.close("another recovery")
            h.gate.open(engine.sock, "full")
            await through_front(c, p, body, stream=True)
            await h.settled()
            assert (ttft("hybrid", "after_recovery"), ttft("hybrid", "steady")) == (1, 2)
            assert (ttft("full", "after_recovery"), ttft("full", "steady")) == (1, 0)
            assert 0 < ttft("hybrid", "after_recovery", "sum") < 30

    h: Any = None
    asyncio.run(main())


def test_requests_that_arrive_during_the_restart_succeed(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        specs = [spec(i, 40) for i in range(8)]
        want = await references(engine, specs)
        async with front_on(engine) as h:
            c = client(h)
            engine.kill()
            # The supervisor has not noticed yet: the gate still says ready, connects fail.
            early = [asyncio.create_task(through_front(c, p, b, i % 4 < 2))
                     for i, (p, b) in enumerate(specs[:4])]
            await until(lambda: h.front.queue_depth == 4, what="4 requests waiting to retry")
            h.gate.close("engine killed by the test")
            late = [asyncio.create_task(through_front(c, p, b, i % 4 < 2))
                    for i, (p, b) in enumerate(specs[4:])]
            await until(lambda: h.front.queue_depth == 8, what="8 requests held")
            async with aiohttp.ClientSession() as s:
                async with s.get(h.base_url[:-3] + "/health") as r:
                    assert r.status == 503
                async with s.get(h.base_url[:-3] + "/ready") as r:
                    assert r.status == 200  # a short restore: keep sending traffic
            engine.start()
            await engine.wait_ready()
            h.gate.open(engine.sock)
            assert await asyncio.gather(*early, *late) == want
            assert not _failures(h)
            await h.settled()
    asyncio.run(main())


def test_queue_deadline_and_full_queue_give_503_with_retry_after(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        async with front_on(engine, queue={"deadline_s": 0.5, "max_waiting": 1,
                                           "retry_after_s": 7}) as h:
            h.gate.close("engine killed by the test")
            c = client(h)
            path, body = spec(0, 8)
            held = asyncio.create_task(through_front(c, path, body, True))
            await until(lambda: h.front.queue_depth == 1, what="one request held")
            with pytest.raises(openai.APIStatusError) as full:
                await through_front(c, path, body, False)
            assert full.value.status_code == 503
            assert full.value.response.headers["retry-after"] == "7"
            assert "max_waiting" in full.value.message
            with pytest.raises(openai.APIStatusError) as late:
                await held
            assert late.value.status_code == 503 and "deadline_s" in late.value.message
            assert late.value.response.headers["retry-after"] == "7"
            assert h.sample("pitstop_front_failed_requests_total", reason="deadline") == 1
            assert h.sample("pitstop_front_failed_requests_total", reason="queue_full") == 1
            assert h.sample("pitstop_front_requests_total", endpoint=COMPLETIONS,
                            code="503") == 2
            async with aiohttp.ClientSession() as s, s.get(h.base_url[:-3] + "/ready") as r:
                assert r.status == 503 and r.headers["Retry-After"] == "7"
            await h.settled()
    asyncio.run(main())


def test_client_gone_mid_resume_frees_its_place(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(0, 400)
        async with front_on(engine) as h, aiohttp.ClientSession() as s:
            r = await stream_started(s, h, path, body)
            h.engine.kill()
            h.gate.close("engine killed by the test")
            await until(lambda: h.front.queue_depth == 1, what="the stream waiting to resume")
            r.close()  # the client goes away while its answer is held
            await h.settled()
            assert h.sample("pitstop_front_failed_requests_total", reason="client_gone") == 1
            engine.start()
            await engine.wait_ready()
            h.gate.open(engine.sock)
            assert await through_front(client(h), *spec(1, 8), stream=True)
    asyncio.run(main())


def test_resume_limit_ends_with_an_error_event(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(0, 1200)
        async with front_on(engine, max_resumes=1) as h:
            progress = [0]
            task = asyncio.create_task(through_front(client(h), path, body, True, progress))
            await until(lambda: progress[0] >= 5, what="the stream under way")
            await h.restart()
            seen = progress[0]
            await until(lambda: progress[0] >= seen + 5, what="the stream resumed")
            h.engine.kill()
            with pytest.raises(openai.APIError) as e:
                await task
            assert "max_resumes=1" in str(e.value)
            assert h.sample("pitstop_front_failed_requests_total", reason="resume_limit") == 1
            await h.settled()
    asyncio.run(main())


def test_pass_through_ids_health_and_engine_errors(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(0, 12)
        want = await engine.direct(path, {**body, "return_token_ids": True})
        async with front_on(engine) as h, aiohttp.ClientSession() as s:
            root = h.base_url[:-3]
            async with s.get(root + "/health") as r:
                assert r.status == 200 and (await r.json())["recovery"] == 1
            async with s.get(root + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == MODEL_NAME
            # The ids the front asks for never reach a client that did not ask.
            async with s.post(root + path, json={**body, "stream": True}) as r:
                raw = await r.read()
                assert r.headers["Content-Type"].startswith("text/event-stream")
            assert b"token_ids" not in raw and raw.endswith(b"data: [DONE]\n\n")
            # A client that asked gets exactly the engine's.
            async with s.post(root + path, json={**body, "stream": True,
                                                 "return_token_ids": True}) as r:
                events = [json.loads(line[6:]) for line in (await r.read()).split(b"\n\n")
                          if line.startswith(b"data: {")]
            ids = [i for e in events for c in e["choices"] for i in c["token_ids"]]
            assert ids == want["choices"][0]["token_ids"]
            assert events[0]["choices"][0]["prompt_token_ids"] == \
                want["choices"][0]["prompt_token_ids"]
            # The engine's refusal is the client's answer, status and body as they were.
            async with s.post(root + path, json={**body, "model": "nope", "stream": True}) as r:
                assert r.status == 404 and "nope" in (await r.json())["error"]["message"]
            async with s.get(root + "/v1/nowhere") as r:
                assert r.status == 404
            h.gate.close("engine killed by the test")
            async with s.get(root + "/health") as r:
                assert r.status == 503 and (await r.json())["reason"] == \
                    "engine killed by the test"
    asyncio.run(main())


def test_stop_drains_streams_in_flight(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(0, 150)
        (want,) = await references(engine, [(path, body)])
        async with front_on(engine) as h:
            progress = [0, 0]
            finishing = asyncio.create_task(through_front(client(h), path, body, True,
                                                          progress, 0))
            await until(lambda: progress[0] >= 3, what="the stream under way")
            await h.front.stop(drain_timeout=60)
            assert finishing.done() and finishing.result() == want
            with pytest.raises(openai.APIConnectionError):
                await through_front(client(h), path, body, False)
    asyncio.run(main())


def test_stop_past_the_drain_ends_streams_with_an_error(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(1, 1500)
        async with front_on(engine) as h:
            progress = [0]
            task = asyncio.create_task(through_front(client(h), path, body, True, progress))
            await until(lambda: progress[0] >= 3, what="the stream under way")
            await h.front.stop(drain_timeout=0.2)
            with pytest.raises(openai.APIError) as e:
                await task
            assert "shutting down" in str(e.value)
    asyncio.run(main())


def test_sampled_stream_continues_with_exact_counts(engine: Engine) -> None:
    """Best effort for sampling: the text after the cut differs, but the client still gets
    exactly max_tokens tokens, the uninterrupted prefix, one id, and true usage."""
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(1, 150, temperature=1.0, seed=7)
        (want,) = await references(engine, [(path, body)])
        async with front_on(engine) as h:
            c = client(h)
            stream = await c.chat.completions.create(
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "seed": 7},
                **{k: v for k, v in body.items() if k in ("model", "messages", "max_tokens",
                                                          "temperature")})
            parts, ids, usage, n = [], set(), None, 0
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.usage is not None:
                    usage = chunk.usage
                for ch in chunk.choices:
                    parts.append(ch.delta.content or "")
                n += 1
                if n == 20:
                    await h.restart()
            text = "".join(parts)
            assert usage is not None and usage.completion_tokens == 150
            direct = await engine.direct(path, body)
            assert usage.prompt_tokens == direct["usage"]["prompt_tokens"]
            assert len(ids) == 1
            cut = len("".join(parts[:19]))
            assert text[:cut] == want[:cut]
            assert h.sample("pitstop_front_resumed_requests_total", endpoint=CHAT) == 1
    asyncio.run(main())


def test_client_gone_mid_stream_aborts_the_engine_request(engine: Engine) -> None:
    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(0, 1500)
        async with front_on(engine) as h, aiohttp.ClientSession() as s:
            r = await stream_started(s, h, path, body)
            r.close()  # the client goes away mid-answer, the engine still generating
            await h.settled()  # the front let go of the engine's request, long before 1500
            assert h.sample("pitstop_front_failed_requests_total", reason="client_gone") == 1
            assert await through_front(client(h), *spec(1, 8), stream=True)
    asyncio.run(main())


def test_a_slow_reader_gets_its_whole_answer(engine: Engine,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that stops reading fills the front's buffers; the front stops reading the
    engine meanwhile (back-pressure) and goes on, losing nothing, once the client reads.
    While it waits, the client's transport wakes it when there is room again: it is not
    woken every few milliseconds to look."""
    drains: list[Suspensions] = []
    real_drain = Relay.drain

    async def counted(self: Relay) -> None:
        drains.append(Suspensions(real_drain(self)))
        await drains[-1]

    monkeypatch.setattr(Relay, "drain", counted)

    async def main() -> None:
        await engine.wait_ready()
        path, body = spec(0, 1200)
        (want,) = await references(engine, [(path, body)])
        async with front_on(engine) as h:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", h.front.port))
            # The kernel would buffer megabytes for a client that does not read: small
            # buffers on the front's side of this connection make ~300 kB enough.
            assert h.front._runner is not None and h.front._runner.server is not None
            server = h.front._runner.server
            await until(lambda: len(server.connections) == 1, what="the front's side")
            (conn,) = server.connections
            assert conn.transport is not None
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            req = json.dumps({**body, "stream": True}).encode()
            await loop.sock_sendall(sock, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                    f"application/json\r\nContent-Length: {len(req)}\r\n"
                                    "Connection: close\r\n\r\n".encode() + req)
            await asyncio.sleep(3)  # not reading: about 1,000 tokens' events pile up
            raw = b""
            while chunk := await loop.sock_recv(sock, 65536):
                raw += chunk
            sock.close()
            head, _, chunked_body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            events, rest = b"", chunked_body
            while True:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size, 16)
                if n == 0:
                    break
                events, rest = events + rest[:n], rest[n + 2:]
            text = "".join(
                (c["delta"].get("content") or "") if path == CHAT else c["text"]
                for ev in events.split(b"\n\n") if ev.startswith(b"data: {")
                for c in json.loads(ev[6:])["choices"])
            assert events.endswith(b"data: [DONE]\n\n") and text == want
            assert drains, "the front never had to wait for the client"
            # Three seconds unread: a wait that polled would have been woken hundreds of times.
            assert max(d.count for d in drains) <= 2, [d.count for d in drains]
            assert not _failures(h)
            await h.settled()
    asyncio.run(main())


class Suspensions:
    """Awaits a coroutine and counts how often it was suspended: each time the event loop
    had to wake it again."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self.count = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        steps = self._coro.__await__()
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                waiting = steps.throw(thrown) if thrown is not None else steps.send(sent)
            except StopIteration as done:
                return done.value
            self.count += 1
            sent, thrown = None, None
            try:
                sent = yield waiting
            except BaseException as e:  # noqa: BLE001 - handed on to the coroutine
                thrown = e


# --- a cut inside a UTF-8 character ------------------------------------------------------
async def engine_events(engine: Engine, path: str, body: dict[str, Any]) -> list[bytes]:
    """A streaming answer straight from the engine's socket, one item per SSE event."""
    async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(engine.sock))) as s, \
            s.post("http://engine" + path, json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.read()
    return [e + b"\n\n" for e in data.split(b"\n\n") if e.strip()]


def _pending(event: bytes, chat: bool) -> bool:
    """An event whose token's text the engine holds back: it ends inside a character."""
    if not event.startswith(b"data: {"):
        return False
    choices = json.loads(event[6:]).get("choices") or [{}]
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
    return bool(c.get("token_ids")) and not text and c.get("finish_reason") is None


async def inside_a_character(engine: Engine, max_tokens: int) -> list[tuple[str, dict[str, Any],
                                                                            list[int]]]:
    """Requests of the `spec` kind, one per endpoint, whose greedy answer has tokens ending
    inside a UTF-8 character before its last token; with the indices of those events. The
    tiny model's weights are random: found by asking the engine, not pinned."""
    found: dict[str, tuple[str, dict[str, Any], list[int]]] = {}
    for i in range(200):
        path, body = spec(i, max_tokens)
        if path in found:
            continue
        chat = path == CHAT
        events = await engine_events(engine, path, {**body, "stream": True,
                                                    "return_token_ids": True})
        at = [k for k, ev in enumerate(events) if _pending(ev, chat)]
        if at:
            found[path] = (path, body, at)
        if len(found) == 2:
            return list(found.values())
    raise AssertionError("no greedy answer of the tiny model ends a token inside a character")


def tracked(plan: Plan, events: list[bytes]) -> tuple[Tracker, bytes]:
    t = Tracker(plan)
    t.begin_attempt()
    return t, b"".join(t.feed(ev) for ev in events)


def client_text(data: bytes, chat: bool) -> tuple[str, list[int]]:
    text, ids = "", []
    for ev in SSEParser().feed(data):
        if ev.done or not ev.data:
            continue
        for c in json.loads(ev.data).get("choices") or []:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            ids += c.get("token_ids") or []
    return text, ids


@pytest.mark.parametrize("client_ids", [False, True])
def test_every_cut_inside_a_character_continues_with_the_same_text(
        engine: Engine, client_ids: bool) -> None:
    """The front's sent offset against the real engine: whichever event the stream is cut
    after, inside a character or not, the continuation the front asks for gives the client
    the uninterrupted text, and each token id once."""
    async def main() -> None:
        await engine.wait_ready()
        for path, body, inside in await inside_a_character(engine, 24):
            chat = path == CHAT
            plan = Plan.of(path, {**body, "stream": True, "return_token_ids": client_ids})
            whole = await engine_events(engine, path, plan.first_body())
            _, sent = tracked(plan, whole)
            want_text, want_ids = client_text(sent, chat)
            assert "\ufffd" not in want_text[-1:]
            for cut in range(1, len(whole) - 1):
                t, sent = tracked(plan, whole[:cut])
                if t.complete:
                    sent += t.finished_frames()
                else:
                    cont_path, cont = t.continuation()
                    t.begin_attempt()
                    for ev in await engine_events(engine, cont_path, cont):
                        sent += t.feed(ev)
                assert t.done
                text, ids = client_text(sent, chat)
                where = f"{path} cut after event {cut} (inside a character: {inside})"
                assert text == want_text, where
                assert ids == (want_ids if client_ids else []), where
    asyncio.run(main())


@pytest.mark.parametrize("client_ids", [False, True])
def test_a_sigkill_inside_a_character_is_resumed_with_the_same_text(
        engine: Engine, client_ids: bool) -> None:
    """Through the real front: the engine is killed when the last event the front got is a
    token that ends inside a character, and the client reads one answer, as if uncut."""
    async def main() -> None:
        await engine.wait_ready()
        for path, body, inside in await inside_a_character(engine, 24):
            chat = path == CHAT
            body = {**body, "return_token_ids": client_ids}
            want = await engine.direct(path, body)
            want_ids = want["choices"][0]["token_ids"] if client_ids else []
            relay = CutRelay(engine.sock, engine.sock.with_name("relay.sock"), inside[-1] + 1)
            await relay.start()
            try:
                async with front_on(engine) as h, aiohttp.ClientSession() as s:
                    h.gate.open(relay.sock)
                    r = await s.post(h.base_url[:-3] + path, json={**body, "stream": True})
                    await asyncio.wait_for(relay.reached.wait(), 60)
                    h.engine.kill()
                    h.gate.close("engine killed by the test")
                    h.engine.start()
                    await h.engine.wait_ready()
                    h.gate.open(relay.sock)
                    text, ids = client_text(await r.read(), chat)
                    assert text == text_of(path, want), path
                    assert ids == want_ids, path
                    assert h.sample("pitstop_front_resumed_requests_total", endpoint=path) == 1
                    assert not _failures(h)
            finally:
                await relay.stop()
    asyncio.run(main())
