"""A Unix-socket to loopback-TCP relay, for engines that can only listen on TCP."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

_CHUNK = 1 << 16


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()  # half-close: the other direction may still be answering
    except (ConnectionError, OSError):
        pass


class UnixTcpRelay:
    """Listens on `path`; every connection is spliced to host:port.

    An engine restored by `vllm snapshot restore` serves on TCP only, while the agent's front,
    health probe and canary speak to engine.socket; the relay joins the two without the agent
    learning a second transport.

    Example::

        relay = UnixTcpRelay(Path("/run/pitstop/engine.sock"), 8001)
        await relay.start()
        ...
        await relay.close()
    """

    def __init__(self, path: Path, port: int, host: str = "127.0.0.1") -> None:
        self.path = path
        self.port = port
        self.host = host
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()
        self._ino: int | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by a killed engine; the bind would fail on it
        self._server = await asyncio.start_unix_server(self._accept, path=str(self.path))
        os.chmod(self.path, 0o600)
        self._ino = os.stat(self.path).st_ino

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            try:
                up_r, up_w = await asyncio.open_connection(self.host, self.port)
            except OSError:
                return  # the engine is not listening: the client sees the connection close
            try:
                await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
            finally:
                up_w.close()
        finally:
            writer.close()
            self._conns.discard(task)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        self._server = None
        # Only our own socket file: the next engine may already have bound the same path.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
