"""One streaming request to the engine, read in the socket's callback: the per-token path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from multidict import CIMultiDict

# The body of a response is handed on piece by piece as it is decoded; `sink` returns True to
# stop reading (the front cut the answer, or the client went away).
Sink = Callable[[bytes], bool]

_MAX_HEAD = 64 * 1024


def _chunk_size(line: bytes) -> int:
    """A chunk's size line: hex digits, then perhaps extensions (';name=value'), ignored."""
    try:
        return int(line, 16)  # the common line, parsed without splitting it first
    except ValueError:
        return int(line.split(b";", 1)[0], 16)


class EngineStream(asyncio.Protocol):
    """An HTTP/1.1 exchange with the engine on a Unix connection of its own.

    aiohttp's client hands every read to a task through a StreamReader, a future and a wake-
    up: about half of the front's CPU per streamed token. Here the engine's bytes are decoded
    (chunked, sized or to the end) in `data_received` and given to `sink` there, which writes
    the client's bytes at once. The connection carries one request (`Connection: close`): a
    connection of a pool might have been closed by the engine meanwhile, which would read as
    an engine crash. Losing the connection before the body's end raises ConnectionResetError
    (one of upstream.LOST) from `finished()`.

    Example::

        s = await EngineStream.open(sock, "POST", "/v1/completions", headers, body)
        if s.status == 200:
            s.stream(lambda piece: False)   # each decoded piece of the body, as it comes
            await s.finished()
        else:
            data = await s.read()
    """

    def __init__(self) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._transport: asyncio.Transport | None = None
        self._head = b""
        self._head_done = asyncio.get_running_loop().create_future()
        self._finished = asyncio.get_running_loop().create_future()
        self._sink: Sink | None = None
        self._attention: asyncio.Future[None] | None = None
        self._error: Exception | None = None  # the sink's own, raised to the caller
        self._held: list[bytes] = []  # body pieces before a sink was given
        # Body framing: "chunked", "length" or "eof"; for chunked, the bytes still owed of
        # the current chunk, or -1 while a size line is read.
        self._framing = "eof"
        self._left = 0
        self._buf = b""
        self._trailer = False

    # --- the caller's side -------------------------------------------------------------------
    @classmethod
    async def open(cls, sock: Path, method: str, path: str, headers: Iterable[tuple[str, str]],
                   body: bytes, connect_timeout: float = 10.0) -> EngineStream:
        """Send the request; returns once the response's head is in (status, headers)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, proto = await loop.create_unix_connection(cls, str(sock))
        except (OSError, TimeoutError) as e:
            # FileNotFoundError and a timeout are no ConnectionError: say "engine gone".
            raise ConnectionRefusedError(f"cannot connect to the engine at {sock}: {e}") from e
        lines = [f"{method} {path} HTTP/1.1", "Host: engine", "Connection: close",
                 f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers]
        assert proto._transport is not None
        proto._transport.write("\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n"
                               + body)
        try:
            await proto._head_done
        except BaseException:
            proto.close()
            raise
        return proto

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").split(";")[0].strip().lower()

    def stream(self, sink: Sink) -> None:
        """From now on every decoded piece of the body goes to `sink`, in the read callback."""
        self._sink = sink
        held, self._held = self._held, []
        for piece in held:
            if self._give(piece):
                return

    async def finished(self) -> None:
        """Until the body's end (or the sink's stop); ConnectionResetError if cut short."""
        await self._finished
        if self._error is not None:
            raise self._error

    async def wait(self) -> bool:
        """Until the body's end (True; raises as `finished` does) or a `poke()` (False)."""
        if not self._finished.done():
            self._attention = asyncio.get_running_loop().create_future()
            await asyncio.wait((self._finished, self._attention),
                               return_when=asyncio.FIRST_COMPLETED)
            self._attention = None
        if self._finished.done():
            self._finished.result()
            if self._error is not None:
                raise self._error
            return True
        return False

    def poke(self) -> None:
        """Wake `wait()` (from the sink: the client reads too slowly, see pause_reading)."""
        if self._attention is not None and not self._attention.done():
            self._attention.set_result(None)

    def pause_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    async def read(self) -> bytes:
        """The whole body (a short answer: an error, a non-streaming response)."""
        await self._finished
        body, self._held = b"".join(self._held), []
        return body

    def close(self) -> None:
        """Drop the connection: the engine aborts the request."""
        if self._transport is not None:
            self._transport.close()
        if not self._finished.done():
            self._finished.set_result(None)

    # --- the event loop's side ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._head_done.done():
            self._head_done.set_exception(ConnectionResetError(
                f"the engine closed the connection before answering ({exc or 'EOF'})"))
            self._finished.set_result(None)  # nobody waits for it: open() raised
        if not self._finished.done():
            if self._framing == "eof" and exc is None:
                self._finished.set_result(None)
            else:
                self._finished.set_exception(ConnectionResetError(
                    f"the engine's answer was cut ({exc or 'EOF before its end'})"))

    def data_received(self, data: bytes) -> None:
        if not self._head_done.done():
            data = self._read_head(data)
            if not data:
                return
        if self._finished.done():
            return
        if self._framing == "chunked":
            self._dechunk(data)
        elif self._framing == "length":
            piece = data[:self._left]
            self._left -= len(piece)
            if piece and self._give(piece):
                return
            if self._left == 0:
                self._end()
        else:
            self._give(data)

    def _read_head(self, data: bytes) -> bytes:
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            self._head = head
            if len(head) > _MAX_HEAD:
                self._fail("the engine's response head is too long")
            return b""
        self._head = b""
        try:
            status, *lines = head[:end].decode("latin-1").split("\r\n")
            self.status = int(status.split(" ", 2)[1])
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines:
                name, _, value = line.partition(":")
                headers.add(name.strip(), value.strip())
        except (ValueError, IndexError):
            self._fail(f"the engine's response head is not HTTP: {head[:200]!r}")
            return b""
        if 100 <= self.status < 200:
            return self._read_head(head[end + 4:])  # an interim answer (100 Continue): next
        self.headers = headers
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._framing, self._left = "chunked", -1
        elif "Content-Length" in self.headers:
            self._framing, self._left = "length", int(self.headers["Content-Length"])
        self._head_done.set_result(None)
        rest = head[end + 4:]
        if self._framing == "length" and self._left == 0:
            self._end()
        return rest

    def _dechunk(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        while pos < n:
            if self._left > 0:  # inside a chunk's data
                piece = buf[pos:pos + self._left]
                pos += len(piece)
                self._left -= len(piece)
                if self._left == 0:
                    if buf.startswith(b"\r\n", pos):  # its CRLF, already here
                        pos += 2
                        self._left = -1
                    else:
                        self._left = -2  # its CRLF next
                if self._give(piece):
                    return
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break  # a line not yet complete
            line = buf[pos:eol]
            pos = eol + 2
            if self._chunk_line(line):
                return
        self._buf = buf[pos:]

    def _chunk_line(self, line: bytes) -> bool:
        """One line between chunks' data: a chunk's size, the CRLF after its data, or a
        trailer; True when the body ended there or is broken."""
        if self._left == -2:  # the CRLF after a chunk's data
            if line:
                self._fail(f"bad chunk end from the engine: {line[:50]!r}")
                return True
            self._left = -1
        elif self._trailer:  # trailer lines until an empty one
            if not line:
                self._end()
                return True
        else:
            try:
                size = _chunk_size(line)
            except ValueError:
                self._fail(f"bad chunk size from the engine: {line[:50]!r}")
                return True
            if size == 0:
                self._trailer = True
            else:
                self._left = size
        return False

    def _give(self, piece: bytes) -> bool:
        if self._sink is None:
            self._held.append(piece)
            return False
        try:
            stop = self._sink(piece)
        except Exception as e:
            # The front's own failure, not the engine's: it must not read as a crash (and
            # the body may have ended already, when it all came in one read).
            self._error = e
            stop = True
        if stop:
            self.close()
        return stop

    def _end(self) -> None:
        if not self._finished.done():
            self._finished.set_result(None)
        if self._transport is not None:
            self._transport.close()

    def _fail(self, message: str) -> None:
        exc = ConnectionResetError(message)
        if not self._head_done.done():
            self._head_done.set_exception(exc)
            self._finished.set_result(None)  # nobody waits for it: open() raises
        elif not self._finished.done():
            self._finished.set_exception(exc)
        if self._transport is not None:
            self._transport.close()
