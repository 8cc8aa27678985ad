"""API keys and TLS at the front, on the real reference engine: a key missing, wrong, or
right but on another route; held requests checked before they are held; the engine never
sees a key; the openai client through TLS (and mutual TLS) with a CA the test makes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from agent.errors import ConfigError
from agent.front.auth import ENV, ApiKeys, read_keys, take_env_key
from agent.tls import ClientAuth, LiveTls, TlsFiles, server_context
from tests.frontkit import MODEL_NAME, Engine, front_on, socket_dir
from tests.tlskit import TestCA

KEY = "sk-pitstop-test-0123456789"
OTHER = "sk-pitstop-other-9876543210"
BODY = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


def key_file(tmp: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp / "api-keys"
    p.write_text(text)
    p.chmod(mode)
    return p


# --- reading the keys -----------------------------------------------------------------------
def test_a_key_file_of_mode_0600_or_0400_gives_its_keys_and_skips_comments(tmp_path):
    p = key_file(tmp_path, f"# the fleet's keys\n{KEY}\n\n  {OTHER}  \n")
    keys = read_keys(p, None)
    assert keys.allows(f"Bearer {KEY}") and keys.allows(f"Bearer {OTHER}")
    p.chmod(0o400)
    assert read_keys(p, None).allows(f"Bearer {OTHER}")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o700, 0o660])
def test_a_key_file_others_could_read_is_refused_with_the_chmod_to_run(tmp_path, mode):
    p = key_file(tmp_path, KEY + "\n", mode)
    with pytest.raises(ConfigError) as e:
        read_keys(p, None)
    assert f"mode {mode:04o}" in str(e.value) and f"chmod 600 {p}" in str(e.value)
    assert KEY not in str(e.value)


def test_a_key_file_of_another_user_is_refused(tmp_path):
    p = key_file(tmp_path, KEY + "\n")
    os.chown(p, 65534, 65534)
    with pytest.raises(ConfigError, match=r"owned by .*uid 65534.*not by the agent's user"):
        read_keys(p, None)


@pytest.mark.parametrize("text, says", [
    ("", "holds no key"),
    ("# only a comment\n\n", "holds no key"),
    (f"{KEY} second-word\n", "line 1: not a key"),
    (f"{KEY}\nkey\twith-a-tab\n", "line 2: not a key"),
    ("sk-caf\u00e9\n", "bytes outside ASCII"),
])
def test_a_key_file_without_usable_keys_is_refused_naming_the_line_not_the_key(
        tmp_path, text, says):
    with pytest.raises(ConfigError) as e:
        read_keys(key_file(tmp_path, text), None)
    assert says in str(e.value)
    assert "second-word" not in str(e.value) and KEY not in str(e.value)


def test_a_missing_key_file_says_what_to_write(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it: No such file.*one key a line"):
        read_keys(tmp_path / "absent", None)


def test_the_environment_key_is_taken_out_of_the_environment_and_vllm_s_is_refused():
    env = {ENV: f" {KEY} \n", "PATH": "/bin"}
    assert take_env_key(env) == KEY and env == {"PATH": "/bin"}
    assert take_env_key({}) is None
    with pytest.raises(ConfigError, match="VLLM_API_KEY: the engine would inherit it"):
        take_env_key({"VLLM_API_KEY": KEY})
    keys = read_keys(None, KEY)
    assert keys.allows(f"Bearer {KEY}") and keys.source == ENV


def test_keys_are_kept_as_digests_and_never_printed(tmp_path):
    keys = read_keys(key_file(tmp_path, KEY + "\n"), OTHER)
    assert KEY not in repr(keys) and OTHER not in repr(keys)
    assert all(KEY.encode() not in d and OTHER.encode() not in d for d in keys.digests)


@pytest.mark.parametrize("header, allowed", [
    (f"Bearer {KEY}", True),
    (f"bearer {KEY}", True),  # the scheme in any case, as vLLM reads it
    (f"BEARER {KEY}", True),
    (None, False),
    ("", False),
    ("Bearer", False),
    ("Bearer ", False),
    (f"Bearer {KEY}x", False),
    (f"Bearer {KEY[:-1]}", False),
    (f"Bearer  {KEY}", False),
    (f"Basic {KEY}", False),
    (KEY, False),
    (f"Bearer {KEY.upper()}", False),
    ("Bearer \ud800", False),  # a lone surrogate hashes instead of raising
])
def test_a_header_is_allowed_only_with_a_key_in_the_bearer_scheme(header, allowed):
    assert ApiKeys(read_keys(None, KEY).digests).allows(header) is allowed


def test_without_keys_nothing_is_required():
    assert not ApiKeys().required


# --- the front on a real engine -----------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    d = socket_dir()
    e = Engine(tiny_model, d / "engine.sock", d / "engine.log", "--kv-slots", "8",
               "--max-model-len", "256")
    e.start()
    asyncio.run(e.wait_ready())
    try:
        yield e
    finally:
        e.kill()
        shutil.rmtree(d, ignore_errors=True)


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _call(s: aiohttp.ClientSession, url: str, method: str = "POST",
                key: str | None = None, **body: Any) -> tuple[int, dict[str, str], bytes]:
    async with s.request(method, url, headers=_auth(key),
                         json={**BODY, **body} if method == "POST" else None) as r:
        return r.status, dict(r.headers), await r.read()


def _is_401(status: int, headers: dict[str, str], data: bytes) -> bool:
    err = json.loads(data)["error"]
    return (status == 401 and headers["Content-Type"].startswith("application/json")
            and headers["WWW-Authenticate"] == "Bearer" and err["type"] == "AuthenticationError"
            and err["code"] == 401 and "Authorization: Bearer" in err["message"])


def test_a_key_missing_wrong_or_right_on_every_route(engine: Engine) -> None:
    async def main() -> None:
        async with front_on(engine, keys=read_keys(None, KEY)) as h, \
                aiohttp.ClientSession() as s:
            base = h.base_url[:-3]
            for stream in (False, True):
                for key in (None, OTHER, KEY[:-1]):
                    r = await _call(s, base + "/v1/completions", key=key, stream=stream)
                    assert _is_401(*r), r  # JSON, also for a stream: nothing was started
                status, headers, data = await _call(s, base + "/v1/completions", key=KEY,
                                                    stream=stream)
                assert status == 200, data
                assert (b"data: [DONE]" in data) is stream
            assert (await _call(s, base + "/v1/models", "GET", key=KEY))[0] == 200
            assert _is_401(*await _call(s, base + "/v1/models", "GET"))
            # The front's own state: open to load balancers, with or without a key.
            for path in ("/health", "/ready"):
                for key in (None, OTHER, KEY):
                    assert (await _call(s, base + path, "GET", key=key))[0] == 200, path
            # Every other route needs the key before anything else is said about it.
            for path in ("/metrics", "/v2/completions", "/", "/v1"):
                assert _is_401(*await _call(s, base + path, "GET")), path
                assert (await _call(s, base + path, "GET", key=KEY))[0] == 404, path
            # An engine's 404 behind the key, as the openai client expects it.
            status, _, data = await _call(s, base + "/v1/nope", "GET", key=KEY)
            assert status == 404 and json.loads(data)["error"]["type"] == "NotFoundError"
            refused = h.sample("pitstop_front_requests_total", endpoint="/v1/completions",
                               code="401")
            assert refused == 6
            await h.settled()

    asyncio.run(main())


def test_a_request_without_a_key_is_refused_before_it_is_held(engine: Engine) -> None:
    async def main() -> None:
        async with front_on(engine, keys=read_keys(None, KEY)) as h, \
                aiohttp.ClientSession() as s:
            url = h.base_url + "/completions"
            h.gate.close("restoring, for the test")
            r = await _call(s, url, key=OTHER)
            assert _is_401(*r) and h.front.queue_depth == 0
            held = asyncio.ensure_future(_call(s, url, key=KEY))
            while h.front.queue_depth == 0:
                await asyncio.sleep(0.01)
            assert not held.done()
            h.gate.open(engine.sock)
            assert (await held)[0] == 200

    asyncio.run(main())


class _Recorder:
    """A Unix socket between the front and the engine that keeps what the front sends."""

    def __init__(self, engine_sock: Path, sock: Path) -> None:
        self.engine_sock, self.sock = engine_sock, sock
        self.sent = b""

    async def serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        er, ew = await asyncio.open_unix_connection(str(self.engine_sock))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       keep: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if keep:
                        self.sent += data
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(r, ew, True), pump(er, w, False))


def test_the_engine_never_sees_a_key(engine: Engine) -> None:
    async def main() -> None:
        rec = _Recorder(engine.sock, engine.sock.with_name("recorder.sock"))
        server = await asyncio.start_unix_server(rec.serve, path=str(rec.sock))
        try:
            async with front_on(engine, keys=read_keys(None, KEY)) as h, \
                    aiohttp.ClientSession() as s:
                h.gate.close("switching to the recorder")
                h.gate.open(rec.sock)
                for stream in (False, True):
                    r = await _call(s, h.base_url + "/completions", key=KEY, stream=stream)
                    assert r[0] == 200, r
        finally:
            server.close()
        assert b"POST /v1/completions" in rec.sent
        assert KEY.encode() not in rec.sent and b"authorization" not in rec.sent.lower()

    asyncio.run(main())


# --- TLS ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"), "pitstop front test CA")


def _client(h: Any, key: str, verify: ssl.SSLContext) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.base_url, api_key=key, max_retries=0, timeout=120,
                              http_client=openai.DefaultAsyncHttpxClient(verify=verify))


async def _complete(c: openai.AsyncOpenAI, stream: bool) -> str:
    if not stream:
        r = await c.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                       max_tokens=6, temperature=0)
        return r.choices[0].text
    parts = [chunk.choices[0].text async for chunk in await c.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0,
        stream=True) if chunk.choices]
    return "".join(parts)


def test_the_openai_client_with_api_key_through_tls_with_the_test_ca(
        engine: Engine, ca: TestCA) -> None:
    server = ca.issue("front", server=True)
    tls = LiveTls(server_context(TlsFiles("front.tls", server.cert, server.key)))
    trusting = ssl.create_default_context(cafile=ca.cert)
    stranger = ssl.create_default_context(cafile=TestCA(ca.directory / "other").cert)

    async def main() -> None:
        async with front_on(engine, keys=read_keys(None, KEY), tls=tls) as h:
            assert h.base_url.startswith("https://127.0.0.1:")
            want = (await engine.direct("/v1/completions", BODY))["choices"][0]["text"]
            async with _client(h, KEY, trusting) as c:
                assert await _complete(c, stream=False) == want
                assert await _complete(c, stream=True) == want
            async with _client(h, OTHER, trusting) as c:
                with pytest.raises(openai.AuthenticationError) as e:
                    await _complete(c, stream=True)
                assert e.value.status_code == 401
            async with _client(h, KEY, stranger) as c:
                with pytest.raises(openai.APIConnectionError):
                    await _complete(c, stream=False)
            # Plain HTTP on the TLS port is no way around it.
            async with aiohttp.ClientSession() as s:
                with pytest.raises(aiohttp.ClientError):
                    await _call(s, f"http://127.0.0.1:{h.front.port}/v1/completions", key=KEY)

    asyncio.run(main())


def test_mutual_tls_serves_only_clients_with_a_certificate_of_the_client_ca(
        engine: Engine, ca: TestCA) -> None:
    server = ca.issue("front-mtls", server=True)
    clients_ca = TestCA(ca.directory / "clients", "pitstop clients CA")
    tls = LiveTls(server_context(TlsFiles(
        "front.tls", server.cert, server.key, client_ca_file=clients_ca.cert,
        client_auth=ClientAuth.REQUIRE_AND_VERIFY)))
    with_cert = ssl.create_default_context(cafile=ca.cert)
    mine = clients_ca.issue("client", server=False)
    with_cert.load_cert_chain(mine.cert, mine.key)
    foreign = ssl.create_default_context(cafile=ca.cert)
    theirs = ca.issue("client-of-another-ca", server=False)
    foreign.load_cert_chain(theirs.cert, theirs.key)

    async def main() -> None:
        async with front_on(engine, keys=read_keys(None, KEY), tls=tls) as h:
            async with _client(h, KEY, with_cert) as c:
                assert await _complete(c, stream=True)
            for ctx in (ssl.create_default_context(cafile=ca.cert), foreign):
                async with _client(h, KEY, ctx) as c:
                    with pytest.raises(openai.APIConnectionError):
                        await _complete(c, stream=False)

    asyncio.run(main())
