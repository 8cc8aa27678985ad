"""The per-token path of a streamed answer: the engine's bytes to the client's, synchronously."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from aiohttp import web

from agent.front.engine_stream import EngineStream
from agent.front.resume import Tracker
from agent.metrics import Metrics


class Relay:
    """The per-token path: engine bytes in, client bytes out, inside the socket's callback.

    Writes go straight to the client's transport, with no task switch per token; a client
    that reads too slowly pauses the engine's socket until it has caught up (`drain`).
    aiohttp's own `StreamResponse.write` is a coroutine (an await, so a task switch, per
    token), and its synchronous writer is private: so the chunk framing of the response
    aiohttp prepared (RFC 9112, 7.1: size in hex, CRLF, data, CRLF) is written here.

    Example::

        relay = Relay(resp, request, tracker, up, metrics, lost_at=None)
        up.stream(relay.feed)            # feed runs in the engine socket's data_received
        while not await up.wait():
            await relay.drain()          # the client caught up: read the engine again
    """

    # asyncio's write-buffer marks for the client's transport: above HIGH it pauses
    # aiohttp's protocol (and the relay the engine's socket), below LOW it resumes it.
    HIGH = 64 * 1024
    LOW = 16 * 1024

    def __init__(self, resp: web.StreamResponse, request: web.Request, tracker: Tracker,
                 up: EngineStream, metrics: Metrics, lost_at: float | None,
                 first_token: Callable[[], None] | None = None) -> None:
        self.tracker, self.up, self.metrics, self.lost_at = tracker, up, metrics, lost_at
        # Called once, at the first bytes of an answer sent on (time to first token).
        self.first_token = first_token
        self.transport = request.transport
        self.writer = request.writer
        self.chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        self.client_gone = ""

    def feed(self, piece: bytes) -> bool:
        """True: stop reading the engine (the answer was cut, or the client went away)."""
        out = self.tracker.feed(piece)
        if out:
            if self.first_token is not None:
                self.first_token()
                self.first_token = None
            if self.lost_at is not None:
                self.metrics.front_stall.observe(time.monotonic() - self.lost_at)
                self.lost_at = None
            t = self.transport
            if t is None or t.is_closing():
                self.client_gone = "the client's connection closed"
                return True
            t.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
            if t.get_write_buffer_size() > self.HIGH:
                self.up.pause_reading()
                self.up.poke()
        # Stopped by the front (a stop string), or the engine said it died: closing the
        # engine's request aborts it.
        return self.tracker.cut or self.tracker.engine_dead

    async def drain(self) -> None:
        # Woken by the transport once its buffer is below LOW (or the client is gone: the
        # next feed finds it closing).
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        self.up.resume_reading()
