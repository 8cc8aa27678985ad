"""The front's streaming client: any framing, any split of the engine's bytes, and cuts."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agent.front.engine_stream import EngineStream
from agent.front.upstream import LOST
from tests.frontkit import socket_dir

EVENTS = [b'data: {"choices": [{"text": "he"}]}\n\n', b'data: {"choices": [{"text": "llo"}]}\n\n',
          b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class Peer:
    """A real server on a Unix socket that answers each connection with canned bytes, in
    the pieces given, and records the request it read."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.pieces: list[bytes] = []
        self.close_after = True
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, str(self.sock))

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        self.requests.append(head + await r.readexactly(length))
        for piece in self.pieces:
            w.write(piece)
            await w.drain()
            await asyncio.sleep(0.001)  # one read each, as an engine's writes come
        if self.close_after:
            w.close()
        else:
            await asyncio.sleep(3600)


def run(test: Callable[[Peer], Awaitable[None]]) -> None:
    """`test` against a fresh peer on a socket of its own."""
    d = socket_dir()

    async def main() -> None:
        peer = Peer(d / "engine.sock")
        await peer.start()
        try:
            await test(peer)
        finally:
            assert peer.server is not None
            peer.server.close()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def collect(peer: Peer) -> tuple[EngineStream, bytes]:
    s = await EngineStream.open(peer.sock, "POST", "/v1/completions",
                                [("Content-Type", "application/json"), ("X-Request-Id", "r1")],
                                b'{"stream": true}')
    got: list[bytes] = []
    s.stream(lambda piece: got.append(piece) is not None)  # never stops
    assert await s.wait()
    return s, b"".join(got)


def splits(data: bytes) -> list[list[bytes]]:
    """The same bytes whole, byte by byte, and in odd-sized pieces."""
    return [[data], [data[i:i + 1] for i in range(len(data))],
            [data[i:i + 7] for i in range(0, len(data), 7)]]


@pytest.mark.parametrize("framing", ["chunked", "length", "eof"])
def test_any_framing_and_any_split_give_the_body(framing: str) -> None:
    async def main(peer: Peer) -> None:
        if framing == "chunked":
            wire = SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)
        elif framing == "length":
            wire = SSE_HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
        else:
            wire = SSE_HEAD + b"\r\n" + BODY
        for pieces in splits(wire):
            peer.pieces = pieces
            s, body = await collect(peer)
            assert body == BODY
            assert s.status == 200 and s.content_type == "text/event-stream"
        # The request went out as sent, on a connection of its own.
        req = peer.requests[-1]
        assert req.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\nConnection: close\r\n" in req and b"\r\nX-Request-Id: r1\r\n" in req
        assert req.endswith(b'\r\n\r\n{"stream": true}')

    run(main)


def test_a_body_cut_before_its_end_is_an_engine_loss() -> None:
    async def main(peer: Peer) -> None:
        wire = SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)
        for cut in (len(SSE_HEAD) + 40, len(wire) - 5, len(wire) - 1):
            peer.pieces = [wire[:cut]]
            with pytest.raises(LOST):
                await collect(peer)
        peer.pieces = [SSE_HEAD[:20]]  # not even a head
        with pytest.raises(LOST):
            await collect(peer)
        peer.pieces = [SSE_HEAD + b"Content-Length: 999\r\n\r\n" + BODY]
        with pytest.raises(LOST):
            await collect(peer)

    run(main)


def test_no_engine_at_the_socket_is_an_engine_loss() -> None:
    async def main(peer: Peer) -> None:
        with pytest.raises(LOST):
            await EngineStream.open(peer.sock.with_name("none.sock"), "POST", "/", [], b"")

    run(main)


def test_an_error_answer_is_read_whole_after_an_interim_one() -> None:
    async def main(peer: Peer) -> None:
        err = b'{"error": {"message": "bad", "code": 400}}'
        peer.pieces = [b"HTTP/1.1 100 Continue\r\n\r\n",
                       b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(err) + err]
        s = await EngineStream.open(peer.sock, "POST", "/v1/completions", [], b"{}")
        assert s.status == 400 and s.content_type == "application/json"
        assert await s.read() == err

    run(main)


def test_the_sink_stops_the_stream_and_later_bytes_are_dropped() -> None:
    async def main(peer: Peer) -> None:
        peer.pieces = [SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n",
                       *[chunked([e])[:-5] for e in EVENTS]]  # chunks, no terminal one
        peer.close_after = False  # the engine would go on: the front must hang up itself
        s = await EngineStream.open(peer.sock, "POST", "/v1/completions", [], b"{}")
        got: list[bytes] = []

        def sink(piece: bytes) -> bool:
            got.append(piece)
            return len(got) == 2

        s.stream(sink)
        assert await asyncio.wait_for(s.wait(), 5)
        assert got == EVENTS[:2]

    run(main)


def test_a_failing_sink_is_the_fronts_error_not_an_engine_loss() -> None:
    async def main(peer: Peer) -> None:
        peer.pieces = [SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)]
        s = await EngineStream.open(peer.sock, "POST", "/v1/completions", [], b"{}")

        def sink(piece: bytes) -> bool:
            raise KeyError("a bug in the front")

        s.stream(sink)
        with pytest.raises(KeyError):
            await s.wait()

    run(main)
