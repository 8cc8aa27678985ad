"""The agent's /metrics over HTTP or HTTPS, with basic auth as the exporter toolkit does it."""

from __future__ import annotations

import asyncio
import base64
import binascii
import gzip
import hashlib
import logging
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import bcrypt
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from agent.errors import FrontError
from agent.tls import LiveTls
from agent.webconfig import WebConfig

log = logging.getLogger("pitstop.metrics")

# An unknown user is checked against this hash too (the toolkit's own): the time taken does
# not tell whether a user exists.
_DUMMY_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
# Prometheus scrapes every few seconds with the same password: bcrypt once, then remember.
_CACHE_SIZE = 64


def _checkpw(password: bytes, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:  # bcrypt 5 refuses passwords longer than its 72 bytes
        return False


class MetricsEndpoint:
    """Serves `registry` at /metrics; the web configuration adds TLS and basic-auth users.

    Scrapes are rendered in a worker thread, and each bcrypt check too (one at a time, so a
    flood of wrong passwords costs one core at most).

    Example::

        ep = MetricsEndpoint(registry, "127.0.0.1", 9410, web, LiveTls(server_context(web.tls)))
        await ep.start()       # ep.port
        ep.use(new_web, new_ctx)   # on reload: new users now, new certificates at the
                                   # next handshake
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 web_config: WebConfig | None = None, tls: LiveTls | None = None) -> None:
        self.registry = registry
        self.host, self.port = host, port
        self.tls = tls
        self.users: dict[str, bytes] = web_config.users if web_config else {}
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._bcrypt = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self.app = web.Application(middlewares=[self._basic_auth])
        self.app.router.add_get("/metrics", self._metrics)

    def use(self, web_config: WebConfig | None, ctx: ssl.SSLContext | None) -> None:
        """A reloaded web configuration: its users for the next scrape, its certificates for
        the next handshake."""
        self.users = web_config.users if web_config else {}
        self._verified.clear()
        if self.tls is not None and ctx is not None:
            self.tls.use(ctx)

    async def start(self) -> None:
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port,
                           ssl_context=self.tls.listening if self.tls else None)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise FrontError(f"cannot listen on {self.host}:{self.port} for metrics: "
                             f"{e.strerror}; change metrics.port or stop what uses it") from e
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        names = request.query.getall("name[]", [])
        registry = self.registry.restricted_registry(names) if names else self.registry
        zipped = gzip_accepted(request.headers.get("Accept-Encoding", ""))

        def render() -> bytes:
            out = encoder(registry)
            return gzip.compress(out) if zipped else out

        body = await asyncio.to_thread(render)
        headers = {"Content-Type": content_type}
        if zipped:
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    @web.middleware
    async def _basic_auth(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        if self.users and not await self._allowed(request.headers.get("Authorization", "")):
            return web.Response(status=401, text="Unauthorized\n",
                                headers={"WWW-Authenticate": 'Basic realm="pitstop metrics"'})
        return await handler(request)

    async def _allowed(self, header: str) -> bool:
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(encoded, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        hashed = self.users.get(user.decode("utf-8", "replace")) if sep else None
        # The cache holds digests of what was verified, never a password.
        seen = hashlib.sha256(b"\0".join((user, password, hashed or b""))).digest()
        if hashed is not None and seen in self._verified:
            self._verified.move_to_end(seen)
            return True
        async with self._bcrypt:
            ok = await asyncio.to_thread(_checkpw, password, hashed or _DUMMY_HASH)
        if ok and hashed is not None:
            self._verified[seen] = None
            if len(self._verified) > _CACHE_SIZE:
                self._verified.popitem(last=False)
            return True
        log.debug("metrics: a scrape with wrong basic-auth credentials was refused")
        return False
