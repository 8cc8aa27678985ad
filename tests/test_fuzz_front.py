"""Fuzzing the real front on the real reference engine: malformed HTTP and JSON, oversized
bodies and slow clients get an answer in bounded time and memory, and the front serves on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.front.auth import ApiKeys, read_keys
from agent.front.proxy import Front
from tests.frontkit import MODEL_NAME, Engine, front_on, socket_dir

pytestmark = pytest.mark.integration

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
MAX_BODY = 64 * 1024
BODY_TIMEOUT_S = 2.0
GOOD = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


class _FrontThread:
    """The front on its own event loop in a thread, so that tests talk to it over sockets."""

    def __init__(self, engine: Engine) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.front: Front | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self._main(engine),), daemon=True)
        self.thread.start()
        assert self._started.wait(30), "the front did not start"

    async def _main(self, engine: Engine) -> None:
        self._stop = asyncio.Event()
        async with front_on(engine, max_body_bytes=MAX_BODY,
                            body_timeout_s=BODY_TIMEOUT_S) as h:
            self.port = h.front.port
            self.front = h.front
            self._started.set()
            await self._stop.wait()

    @contextlib.contextmanager
    def keys(self, keys: ApiKeys) -> Iterator[None]:
        """API keys in effect on the running front for a while (as a reload sets them)."""
        assert self.front is not None
        front = self.front

        async def use(k: ApiKeys) -> None:
            front.keys = k

        asyncio.run_coroutine_threadsafe(use(keys), self.loop).result(10)
        try:
            yield
        finally:
            asyncio.run_coroutine_threadsafe(use(ApiKeys()), self.loop).result(10)

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def front(tiny_model: Path) -> Iterator[_FrontThread]:
    d = socket_dir()
    engine = Engine(tiny_model, d / "engine.sock", d / "engine.log", "--kv-slots", "8",
                    "--max-model-len", "256")
    engine.start()
    asyncio.run(engine.wait_ready())
    f = _FrontThread(engine)
    try:
        yield f
    finally:
        f.stop()
        engine.kill()
        shutil.rmtree(d, ignore_errors=True)


def _exchange(port: int, data: bytes, timeout: float = 10.0, half_close: bool = False,
              until_head: bool = False) -> bytes:
    """Send `data` (then half-close: a client gone), read until the front closes (or, with
    `until_head`, until the head of its answer is in)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while not (until_head and b"\r\n\r\n" in out) and (chunk := s.recv(65536)):
                out += chunk
        return out


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + extra + \
        b"\r\n" + body


def _status_and_body(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _assert_openai_error(raw: bytes) -> None:
    status, body = _status_and_body(raw)
    assert 400 <= status < 600, raw[:300]
    if b"transfer-encoding: chunked" in raw.lower().split(b"\r\n\r\n")[0]:
        return  # the engine's own (streamed) error; checked by the engine's tests
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err, body


def _serves(front: _FrontThread) -> None:
    raw = _exchange(front.port, _post("/v1/completions", json.dumps(GOOD).encode()), 60)
    assert _status_and_body(raw)[0] == 200, raw[:500]


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                               max_size=4), max_leaves=10)
bodies = st.one_of(
    st.binary(max_size=600),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"model": st.sampled_from([MODEL_NAME, "other", 3])}, optional={
        "prompt": json_value, "messages": json_value, "max_tokens": st.integers(-5, 10),
        "stream": json_value, "temperature": json_value, "n": st.integers(-1, 3),
        "stop": json_value, "logprobs": json_value, "stream_options": json_value,
    }).map(lambda d: json.dumps(d).encode()),
    st.integers(0, len(json.dumps(GOOD))).map(lambda n: json.dumps(GOOD).encode()[:n]),
)


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models",
                             "/v1/nope"]), body=bodies)
def test_any_json_body_gets_an_openai_shaped_answer(front, path, body):
    raw = _exchange(front.port, _post(path, body), 60)
    status, _ = _status_and_body(raw)
    if status >= 400:
        _assert_openai_error(raw)


# Header lines a client may send, well formed or not, with or without the body they announce.
HEADER_LINES = [b"Content-Type: application/json", b"Content-Type: text/plain",
                b"Content-Length: 0", b"Content-Length: 3", b"Content-Length: x",
                b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip",
                b"Expect: 100-continue", b"Connection: close", b"X-Request-Id: \xff\xfe",
                b"Accept-Encoding: gzip"]
http_garbage = st.one_of(
    st.binary(min_size=1, max_size=800),
    # A Host header first (HTTP/1.1 is refused without one, by the parser, before the front),
    # and lines the parser takes: most heads reach the front's own handler.
    st.tuples(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"\x00", b"BREW"]),
              st.one_of(st.binary(max_size=40), st.from_regex(rb"[a-z0-9/._~-]{0,20}",
                                                              fullmatch=True)),
              st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9", b""]),
              st.lists(st.one_of(st.binary(max_size=60), st.sampled_from(HEADER_LINES)),
                       max_size=5))
    .map(lambda t: t[0] + b" /v1/" + t[1] + b" " + t[2] + b"\r\nHost: x\r\n"
         + b"\r\n".join(t[3]) + b"\r\n\r\n"),
    st.integers(1, 120).map(lambda n: _post("/v1/completions", json.dumps(GOOD).encode())[:n]),
)


@FUZZ
@given(data=http_garbage)
def test_malformed_http_is_answered_or_closed_at_once_and_the_front_serves_on(front, data):
    # A request head that arrived whole (after the empty lines a server skips) is answered,
    # by the client still connected; one cut short, the client then gone (half-close), is
    # answered or closed at once.
    whole = b"\r\n\r\n" in data.lstrip(b"\r\n")
    t0 = time.monotonic()
    raw = _exchange(front.port, data, half_close=not whole, until_head=whole)
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3
    if whole or raw:
        # A status line (aiohttp says HTTP/0.9 to a request line without a version).
        assert re.match(rb"HTTP/\d\.\d [1-5]\d\d ", raw), raw[:200]


def test_the_front_serves_after_the_fuzzing(front):
    _serves(front)


KEY = "sk-fuzz-0123456789abcdef"
# Header values as clients, scanners and broken proxies send them: any bytes but the line
# ends that would end the header, and near misses of the key.
authorization = st.one_of(
    st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.tuples(st.sampled_from([b"Bearer", b"bearer", b"BEARER", b"Basic", b"Bearer:", b""]),
              st.sampled_from([b" ", b"  ", b"\t", b""]),
              st.sampled_from([KEY.encode(), KEY[:-1].encode(), KEY.encode() + b"x",
                               KEY.upper().encode(), b"", "sk-é".encode()]),
              st.binary(max_size=8).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))
    .map(b"".join),
)


@FUZZ
@given(value=authorization, path=st.sampled_from(["/v1/completions", "/v1/models", "/metrics",
                                                  "/v1/nope"]))
def test_any_authorization_header_is_answered_and_only_the_key_opens(front, value, path):
    with front.keys(read_keys(None, KEY)):
        raw = _exchange(front.port, _post(path, json.dumps(GOOD).encode(),
                                          b"Authorization: " + value + b"\r\n"), 60)
    status, body = _status_and_body(raw)
    assert status < 500, raw[:500]
    scheme, _, token = value.partition(b" ")
    if status == 401:
        assert json.loads(body)["error"]["type"] == "AuthenticationError"
    elif status != 400:  # 400: the HTTP parser refused the header itself
        assert scheme.lower() == b"bearer" and token.strip(b" \t") == KEY.encode(), raw[:300]


def test_the_front_serves_with_a_key_after_the_header_fuzzing(front):
    with front.keys(read_keys(None, KEY)):
        raw = _exchange(front.port, _post("/v1/completions", json.dumps(GOOD).encode(),
                                          f"Authorization: Bearer {KEY}\r\n".encode()), 60)
        assert _status_and_body(raw)[0] == 200, raw[:500]
        raw = _exchange(front.port, _post("/v1/completions", json.dumps(GOOD).encode()), 60)
        assert _status_and_body(raw)[0] == 401, raw[:500]
    _serves(front)


def _rss_mib() -> float:
    """This process's resident memory now (the front runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_an_oversized_body_is_refused_with_an_openai_error_without_reading_it_all(front):
    size = 64 * 1024**3  # announced; sent a MiB at a time until the front closes
    before = _rss_mib()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as s:
        s.sendall(_post("/v1/completions", b"")[:-2].replace(b"Content-Length: 0",
                                                              f"Content-Length: {size}".encode())
                  + b"\r\n")
        sent, chunk = 0, b"x" * (1 << 20)
        with contextlib.suppress(OSError):
            while sent < size:
                s.sendall(chunk)
                sent += len(chunk)
        raw = b""
        with contextlib.suppress(ConnectionResetError):
            while part := s.recv(65536):
                raw += part
    assert time.monotonic() - t0 < 20  # the front closed: it does not read 64 GiB
    assert sent < size
    assert _rss_mib() - before < 32
    assert _status_and_body(raw)[0] == 413, raw[:300]
    _assert_openai_error(raw)
    assert "front.max_body_bytes" in json.loads(_status_and_body(raw)[1])["error"]["message"]
    _serves(front)


def test_a_client_that_stops_sending_its_body_gets_a_timeout_answer(front):
    body = json.dumps(GOOD).encode()
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as s:
        s.sendall(_post("/v1/completions", body)[:-len(body) // 2])  # half the body, then quiet
        t0 = time.monotonic()
        raw = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                raw += chunk
        waited = time.monotonic() - t0
    assert BODY_TIMEOUT_S - 0.5 < waited < BODY_TIMEOUT_S + 5
    assert _status_and_body(raw)[0] == 408, raw[:300]
    _assert_openai_error(raw)
    _serves(front)


def test_many_slow_clients_at_once_are_all_timed_out_and_the_front_serves_meanwhile(front):
    socks = []
    try:
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
            s.sendall(_post("/v1/completions", b"{" * 100)[:-50])
            socks.append(s)
        _serves(front)  # a good client is not held up by the slow ones
        time.sleep(BODY_TIMEOUT_S + 1)
        for s in socks:
            assert _status_and_body(s.recv(65536))[0] == 408
    finally:
        for s in socks:
            s.close()
    assert Path("/proc/self").exists()
