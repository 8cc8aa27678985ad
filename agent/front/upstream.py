"""HTTP client sessions to the engine's Unix socket, one per engine generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping

import aiohttp
from multidict import CIMultiDict

from agent.supervisor.gate import Ready

# Hop-by-hop headers (RFC 9110 7.6.1), and those each side's HTTP stack writes itself:
# never forwarded.
_NOT_FORWARDED = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Content-Encoding",
    "Accept-Encoding", "Server", "Date",
    # The front has read the client's body already: an engine must not wait to be asked.
    "Expect",
    # The front checks API keys; the engine behind its private socket needs none, and
    # never sees (or logs) a client's key.
    "Authorization"))

# Errors that mean the engine went away under a request (killed, restarted, socket gone).
LOST = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError,
        asyncio.IncompleteReadError)


def forward_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """End-to-end headers only. Accept-Encoding is dropped so the engine answers in plain
    bytes that the front can parse; the public side may still be compressed by a proxy."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    return CIMultiDict((k, v) for k, v in items if k.lower() not in _NOT_FORWARDED)


class Upstream:
    """Client sessions to the engine, keyed by recovery.

    A session's pooled keep-alive connections belong to one engine process; after a
    recovery they are dead, so each recovery gets a fresh session and the old one is closed
    once its last request is done. Before a snapshot `close_idle` drops them all.

    Example::

        up = Upstream()
        async with up.session(ready) as s:
            async with s.post("http://engine/v1/completions", json=body) as r: ...
    """

    def __init__(self, connect_timeout: float = 10.0) -> None:
        self._sessions: dict[int, aiohttp.ClientSession] = {}
        self._users: dict[int, int] = {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)

    def _get(self, ready: Ready) -> aiohttp.ClientSession:
        s = self._sessions.get(ready.recovery)
        if s is None:
            # limit=0: the engine schedules its own batch; the proxy must not queue for it.
            conn = aiohttp.UnixConnector(path=str(ready.socket), limit=0)
            # DummyCookieJar: a proxy must not keep one client's cookies for the next.
            s = aiohttp.ClientSession(connector=conn, timeout=self._timeout,
                                      auto_decompress=False, skip_auto_headers=("User-Agent",),
                                      cookie_jar=aiohttp.DummyCookieJar())
            self._sessions[ready.recovery] = s
            self._users[ready.recovery] = 0
        return s

    @contextlib.asynccontextmanager
    async def session(self, ready: Ready):  # noqa: ANN201 - an async context manager
        s = self._get(ready)
        self._users[ready.recovery] += 1
        try:
            yield s
        finally:
            self._users[ready.recovery] -= 1
            await self._close_old()

    async def _close_old(self) -> None:
        newest = max(self._sessions)
        for rec in [r for r in self._sessions if r < newest and self._users[r] == 0]:
            s = self._sessions.pop(rec)
            del self._users[rec]
            await s.close()

    async def close_idle(self) -> None:
        """Close every session no request is using, with its pooled connections; the next
        request opens a new one. Before a snapshot: an idle keep-alive connection is a
        connection from outside the engine's tree, which CRIU cannot dump."""
        for rec in [r for r, n in self._users.items() if n == 0]:
            s = self._sessions.pop(rec)
            del self._users[rec]
            await s.close()  # aiohttp waits until each transport is closed

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()
        self._users.clear()
