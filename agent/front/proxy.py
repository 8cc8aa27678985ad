"""The public OpenAI port: forwards to the engine, holds across restores, resumes streams."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from agent.config import FrontConfig
from agent.errors import FrontError, FrontRejected
from agent.front.auth import ApiKeys, key_check
from agent.front.engine_stream import EngineStream
from agent.front.holding import FrontFailure, Holding
from agent.front.relay import Relay
from agent.front.resume import CHAT, COMPLETIONS, Plan, Tracker
from agent.front.sse import error_body, error_frame
from agent.front.upstream import LOST, Upstream, forward_headers
from agent.holder.kvledger import (
    KV_HEADER,
    KV_KEPT_HEADER,
    REQUEST_HEADER,
    RESUME_HEADER,
    KeptKVOutcome,
)
from agent.metrics import Children, Metrics
from agent.supervisor.gate import EngineGate, Ready
from agent.tls import LiveTls

log = logging.getLogger("pitstop.front")

_ENDPOINTS = (COMPLETIONS, CHAT, "/v1/models")
# Answered from the front's own state, never the engine's: open to load balancers when API
# keys are in effect (every other path, /metrics included, needs a key).
_OPEN_PATHS = frozenset(("/health", "/ready"))
# A scrape of a hung engine must not hang the front's handler past Prometheus' own timeout.
_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=10)
_ENGINE = "http://engine"  # the host part is unused: the connector dials the Unix socket


def _endpoint(path: str) -> str:
    """The metrics label: the three known endpoints by name, every other path as 'other'."""
    return path if path in _ENDPOINTS else "other"


# The `type` OpenAI's API gives the errors a router or the front itself answers.
_ERROR_KINDS = {400: "BadRequestError", 404: "NotFoundError", 405: "BadRequestError",
                408: "BadRequestError", 413: "BadRequestError", 415: "BadRequestError",
                422: "UnprocessableEntityError"}


def _json_error(status: int, message: str, retry_after: int | None = None,
                kind: str = "ServiceUnavailableError") -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(error_body(message, status, kind), status=status, headers=headers)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Failed(Exception):
    """A request the front gives up on: `reason` is the metric label."""

    def __init__(self, reason: FrontFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _EngineDead(Exception):
    """The engine answered with an error that says it is dead (vLLM's EngineDeadError)."""


class _ClientGone(Exception):
    """The client's connection broke while the front wrote to it (not the engine's)."""


async def _send(resp: web.StreamResponse, data: bytes) -> None:
    # A write error is the client's side: it must never read as an engine crash to resume.
    try:
        await resp.write(data)
    except ConnectionError as e:
        raise _ClientGone(str(e)) from e


class Front:
    """Owns the public TCP port and forwards OpenAI requests to the engine's Unix socket.

    New requests wait (bounded, with a deadline) while the gate is closed; a streaming
    answer cut by an engine crash is continued on the recovered engine from the last token
    sent; a non-streaming one is sent again whole. `queue_depth` is read by the metrics
    collector at scrape time (the requests in flight are the gate's count).

    Example::

        front = Front(config.front, gate, metrics)
        await front.start()          # listening on front.port
        ...
        await front.stop(drain_timeout=10)
    """

    def __init__(self, config: FrontConfig, gate: EngineGate, metrics: Metrics,
                 engine_metrics_path: str | None = None,
                 engine_dead_marker: bytes | None = None, keys: ApiKeys | None = None,
                 tls: LiveTls | None = None) -> None:
        self.config = config
        # Replaced whole on reload (agent/access.py reads them); TLS contexts likewise.
        self.keys = keys or ApiKeys()
        self.tls = tls
        # In an engine's 5xx answer: the engine is dead (EngineAdapter.dead_marker), so the
        # request is lost like one cut by a crash, not the client's error to see.
        self._dead_marker = engine_dead_marker
        # The engine's own Prometheus exposition (vLLM's /metrics), served at the front's
        # /metrics; None when the engine has none.
        self._engine_metrics_path = engine_metrics_path
        self.gate = gate
        self.metrics = metrics
        # Looked up per request: each label child once (metrics.Children).
        self._answered = Children(metrics.front_requests)
        self._first_token_hist = Children(metrics.front_first_token)
        self.holding = Holding(gate, config.queue, metrics)
        self.upstream = Upstream()
        # Before a snapshot the pooled connections go: CRIU cannot dump half of a connection.
        gate.on_quiesce(self.upstream.close_idle)
        # The latest recovery whose engine was sent its first streamed request: that request's
        # first token is the one after a recovery, every later one's is steady state.
        self._first_stream_of = 0
        self.port: int | None = None
        self._active: set[asyncio.Task[Any]] = set()  # handlers of admitted requests
        self._idle = asyncio.Event()
        self._idle.set()
        self._shutting_down = False
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.app = web.Application(
            client_max_size=config.max_body_bytes,
            middlewares=[key_check(lambda: self.keys, _OPEN_PATHS, self._refused)])
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/ready", self._ready)
        if engine_metrics_path:
            self.app.router.add_get("/metrics", self._engine_metrics)
        self.app.router.add_route("*", "/v1/{tail:.*}", self._proxy)

    def reconfigure(self, config: FrontConfig) -> None:
        """Take a reloaded front section; host, port and max_body_bytes keep their values
        from the start (the reload policy refuses changes to them)."""
        self.config = config
        self.holding.reconfigure(config.queue)

    def use_access(self, keys: ApiKeys, ctx: ssl.SSLContext | None) -> None:
        """Keys and a certificate read again (a reload): new requests and handshakes use
        them. TLS itself stays on or off as the front started."""
        self.keys = keys
        if self.tls is not None and ctx is not None:
            self.tls.use(ctx)

    @property
    def queue_depth(self) -> int:
        return self.holding.depth

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        # handler_cancellation: a client that goes away cancels its handler, which closes
        # the engine request (the engine aborts it) and frees its place at once.
        # lingering_time: after refusing a body (too large, too slow) aiohttp drains what the
        # client still sends before closing; one second bounds that for any client.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=1.0, lingering_time=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port,
                           ssl_context=self.tls.listening if self.tls else None)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise FrontError(
                f"cannot listen on {self.config.host}:{self.config.port}: {e.strerror}; is "
                "another server (vLLM itself?) on that port? Change front.port or stop it"
            ) from e
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("front listening on %s:%d (%s, %s)", self.config.host, self.port,
                 "TLS" if self.tls else "no TLS",
                 f"API keys from {self.keys.source}" if self.keys.required else "no API key")

    async def stop(self, drain_timeout: float) -> None:
        """Stop admitting, let requests in flight finish for up to `drain_timeout` s, close.

        Requests still running then get an error event (streams) before the port closes.
        """
        if self._runner is None:
            return
        self.holding.stop()
        for site in list(self._runner.sites):
            await site.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
        if self._active:
            log.warning("front: %d requests still running after the %.1f s drain; ending them",
                        len(self._active), drain_timeout)
            self._shutting_down = True
            for task in list(self._active):
                task.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 2.0)
        await self._runner.cleanup()
        await self.upstream.close()
        self._runner = None

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[None]:
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        self._idle.clear()
        try:
            yield
        finally:
            self._active.discard(task)
            if not self._active:
                self._idle.set()

    def _refused(self, request: web.Request) -> None:
        """A request without a valid API key: counted, never logged with its header."""
        self._answered(_endpoint(request.path), 401).inc()

    # --- the front's own endpoints ---------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        """200 only while the engine is verified and admitting: vLLM's /health meaning."""
        ready = self.gate.current
        if ready is None:
            return web.json_response(
                {"status": "down", "reason": self.gate.down_reason or "paused"}, status=503)
        return web.json_response({"status": "ok", "recovery": ready.recovery})

    async def _ready(self, request: web.Request) -> web.Response:
        """For load balancers: 200 while a new request would be served or held for a short
        restore; 503 once the engine has been down longer than the queue deadline, the queue
        is full, or the front is stopping."""
        if self.holding.would_admit():
            return web.json_response({"ready": True, "queue_depth": self.queue_depth})
        return web.json_response(
            {"ready": False, "reason": "draining" if self.holding.stopping else
             (self.gate.down_reason or "queue full")}, status=503,
            headers={"Retry-After": str(self.config.queue.retry_after_s)})

    async def _engine_metrics(self, request: web.Request) -> web.Response:
        """The engine's own metrics, passed through as they are. Never held like a client
        request: a scrape while the engine is down fails at once, so Prometheus records a gap
        (up == 0) rather than numbers of an engine that is gone."""
        ready = self.gate.current
        if ready is None:
            return web.Response(status=503, text="engine down: "
                                f"{self.gate.down_reason or 'paused for a snapshot'}\n")
        try:
            # Counted on the gate: a snapshot waits for a scrape as for any engine request.
            with self.gate.request():
                return await self._scrape(ready, request)
        except (*LOST, TimeoutError) as e:
            return web.Response(status=503, text=f"engine metrics unavailable: {_describe(e)}\n")

    async def _scrape(self, ready: Ready, request: web.Request) -> web.Response:
        assert self._engine_metrics_path is not None
        async with self.upstream.session(ready) as s, s.get(
                _ENGINE + self._engine_metrics_path, headers=forward_headers(request.headers),
                timeout=_SCRAPE_TIMEOUT) as up:
            data = await up.read()
            return web.Response(status=up.status, body=data,
                                headers=forward_headers(up.headers.items()))

    # --- forwarding ------------------------------------------------------------------------
    def _first_token_timer(self, ready: Ready) -> Callable[[], None]:
        """Started as a new stream is forwarded; called at its first token, it observes."""
        phase = "steady"
        if ready.recovery > self._first_stream_of:
            self._first_stream_of = ready.recovery
            phase = "after_recovery"
        hist = self._first_token_hist(ready.path, phase)
        sent = time.monotonic()
        return lambda: hist.observe(time.monotonic() - sent)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        endpoint = _endpoint(request.path)
        rid = request.headers.get("X-Request-Id") or f"front-{next(self._ids)}"
        try:
            resp = await self._serve(request, rid)
        except FrontRejected as e:
            log.info("request %s rejected (%s): %s", rid, e.reason, e)
            resp = _json_error(503, str(e), retry_after=e.retry_after)
        except asyncio.CancelledError:
            if not self._shutting_down:
                self.metrics.front_failed.labels(reason=FrontFailure.CLIENT_GONE).inc()
                log.info("request %s: client went away", rid)
            raise
        self._answered(endpoint, resp.status).inc()
        return resp

    async def _serve(self, request: web.Request, rid: str) -> web.StreamResponse:
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            log.info("request %s: body not received within %g s", rid, cfg.body_timeout_s)
            resp = _json_error(408, f"the request body did not arrive within "
                               f"front.body_timeout_s={cfg.body_timeout_s:g} s",
                               kind="BadRequestError")
            resp.force_close()  # never wait on that client again
            return resp
        except web.HTTPRequestEntityTooLarge:
            resp = _json_error(413, f"the request body is larger than front.max_body_bytes="
                               f"{cfg.max_body_bytes} bytes; send a shorter one or raise it",
                               kind="BadRequestError")
            resp.force_close()  # the rest of the body is not read, only dropped with the socket
            return resp
        body: dict[str, Any] | None = None
        if request.method == "POST" and request.path in (COMPLETIONS, CHAT) and raw:
            with contextlib.suppress(ValueError):
                parsed = json.loads(raw)
                body = parsed if isinstance(parsed, dict) else None
        ready = await self.holding.admit()
        with self._admitted():
            if body is not None and body.get("stream"):
                return await self._stream(request, rid, ready, body)
            return await self._whole(request, rid, ready, raw)

    async def _recovered(self, rid: str, lost: Ready, why: str) -> Ready:
        """The next engine after the one that died under request `rid`, or _Failed."""
        log.warning("request %s: engine of recovery %d lost (%s); waiting for the next one",
                    rid, lost.recovery, why)
        ready = await self.holding.resume(lost.recovery, self.config.resume_wait_s)
        if ready is None:
            if self.holding.stopping:
                raise _Failed(FrontFailure.DRAINING, "the front is shutting down")
            raise _Failed(FrontFailure.ENGINE_LOST,
                          f"the engine died (recovery {lost.recovery}) and no "
                          f"engine recovered within front.resume_wait_s="
                          f"{self.config.resume_wait_s:g} s")
        return ready

    async def _whole(self, request: web.Request, rid: str, ready: Ready,
                     raw: bytes) -> web.StreamResponse:
        """A non-streaming request: forwarded, and sent again whole if the engine dies."""
        endpoint = _endpoint(request.path)
        headers = forward_headers(request.headers)
        attempts = 0
        while True:
            try:
                with self.gate.request():
                    async with self.upstream.session(ready) as s, s.request(
                            request.method, _ENGINE + request.path_qs, data=raw,
                            headers=headers) as up:
                        if up.content_type == "text/event-stream":
                            return await self._pass_stream(request, rid, up)
                        data = await up.read()
                        self._check_alive(up.status, data)
                        if up.status >= 400 and up.content_type != "application/json":
                            # A router's plain-text 404/405: clients (the openai library)
                            # expect the OpenAI error shape from every endpoint.
                            return _json_error(up.status, data.decode(errors="replace")[:1000],
                                               kind=_ERROR_KINDS.get(up.status, "APIError"))
                        return web.Response(status=up.status, body=data,
                                            headers=forward_headers(up.headers.items()))
            except (*LOST, _EngineDead) as e:
                why = _describe(e)
            try:
                self._within_resume_limit(attempts)
                new = await self._recovered(rid, ready, why)
            except _Failed as f:
                return self._give_up(rid, f.reason, str(f))
            attempts += 1
            self.metrics.front_resumed.labels(endpoint=endpoint).inc()
            log.warning("request %s: sent again whole to recovery %d (lost on recovery %d)",
                        rid, new.recovery, ready.recovery)
            ready = new

    def _check_alive(self, status: int, body: bytes) -> None:
        if self._dead_marker is not None and status >= 500 and self._dead_marker in body:
            raise _EngineDead(f"the engine answered {status} and says it is dead: "
                              f"{body[:200].decode(errors='replace')}")

    def _give_up(self, rid: str, reason: FrontFailure, message: str) -> web.Response:
        self.metrics.front_failed.labels(reason=reason).inc()
        log.error("request %s failed (%s): %s", rid, reason, message)
        return _json_error(503, message, retry_after=self.config.queue.retry_after_s)

    async def _pass_stream(self, request: web.Request, rid: str,
                           up: Any) -> web.StreamResponse:
        """An event stream the front cannot resume (an endpoint it does not know)."""
        resp = web.StreamResponse(status=up.status, headers=forward_headers(up.headers.items()))
        await resp.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                await _send(resp, chunk)
        except _ClientGone:
            self.metrics.front_failed.labels(reason=FrontFailure.CLIENT_GONE).inc()
            return resp
        except LOST as e:
            self.metrics.front_failed.labels(reason=FrontFailure.ENGINE_LOST).inc()
            log.error("request %s: engine lost mid-stream, not resumable: %s", rid, _describe(e))
            await resp.write(error_frame("the engine died during this answer"))
        await resp.write_eof()
        return resp

    def _count_kv_resume(self, rid: str, outcome: str, kept: str) -> None:
        try:
            o = KeptKVOutcome(outcome)
        except ValueError:
            o = KeptKVOutcome.NOT_REPORTED  # vLLM, or an engine without the holder
        self.metrics.front_kv_resumes.labels(outcome=o.value).inc()
        log.info("request %s: the recovered engine %s", rid,
                 f"continued from kept KV ({kept} positions)" if o is KeptKVOutcome.KEPT
                 else f"prefilled the whole context again ({o.value})")

    async def _stream(self, request: web.Request, rid: str, ready: Ready,
                      body: dict[str, Any]) -> web.StreamResponse:
        """A streaming completion: forwarded as it comes, continued across engine deaths."""
        call = _Call.of(request, rid, ready, body, self._dead_marker)
        try:
            while True:
                why = await self._attempt(call)
                if call.answer is not None:
                    return call.answer
                ended = await self._ended(call)
                if ended is not None:
                    return ended
                await self._continue(call, why)
        except (_ClientGone, _Failed, asyncio.CancelledError) as e:
            return await self._stream_failed(call, e)

    async def _attempt(self, call: _Call) -> str:
        """One request to the engine for `call`, relayed to the client; why it ended short
        of the answer's end ("" when it did not). The engine's own answer instead of a
        stream goes in `call.answer`."""
        call.relay = None
        # Only a new request's first answer: a resumed one's pause is a stall.
        timer = self._first_token_timer(call.ready) if call.attempts == 0 else None
        try:
            with self.gate.request():
                up = await EngineStream.open(call.ready.socket, "POST", call.path,
                                             call.headers.items(),
                                             json.dumps(call.body).encode())
                try:
                    if up.status != 200 or up.content_type != "text/event-stream":
                        call.answer = await self._engine_answer(call, up)
                        return ""
                    return await self._relay(call, up, timer)
                finally:
                    up.close()
        except (*LOST, _EngineDead) as e:
            if call.relay is not None:
                call.lost_at = call.relay.lost_at
            return _describe(e)

    async def _engine_answer(self, call: _Call, up: EngineStream) -> web.Response:
        """The engine's own answer (a 400 for a bad request), as it is, while the client has
        had nothing; once it has, a continuation the engine refused fails the request."""
        data = await up.read()
        self._check_alive(up.status, data)
        if call.resp is not None:
            raise _Failed(FrontFailure.ENGINE_ERROR, "the recovered engine refused the "
                          f"continuation: {up.status} {data[:500]!r}")
        return web.Response(status=up.status, body=data,
                            headers=forward_headers(up.headers.items()))

    async def _relay(self, call: _Call, up: EngineStream,
                     timer: Callable[[], None] | None) -> str:
        """The engine's events to the client until the engine's answer ends; why it ended
        short of the whole answer ("" when it did not)."""
        if call.attempts:
            self._count_kv_resume(call.rid, up.headers.get(KV_HEADER, ""),
                                  up.headers.get(KV_KEPT_HEADER, "0"))
        if call.resp is None:
            call.resp = web.StreamResponse(status=200,
                                           headers=forward_headers(up.headers.items()))
            await call.resp.prepare(call.request)
        call.tracker.begin_attempt()
        relay = call.relay = Relay(call.resp, call.request, call.tracker, up, self.metrics,
                                   call.lost_at, timer)
        up.stream(relay.feed)
        while not await up.wait():
            await relay.drain()
        call.lost_at = relay.lost_at
        if relay.client_gone:
            raise _ClientGone(relay.client_gone)
        if call.tracker.engine_dead:
            return "the engine said it died during this answer"
        return "" if call.tracker.done else "the engine's stream ended without [DONE]"

    async def _ended(self, call: _Call) -> web.StreamResponse | None:
        """The response once the answer is whole, or all its tokens were sent before the
        engine died; None when it must be continued."""
        if call.tracker.done:
            assert call.resp is not None
            await call.resp.write_eof()
            return call.resp
        # The engine died under this answer.
        call.lost_at = call.lost_at or time.monotonic()
        if call.resp is not None and call.tracker.complete:
            await call.resp.write(call.tracker.finished_frames())
            await call.resp.write_eof()
            return call.resp
        return None

    async def _continue(self, call: _Call, why: str) -> None:
        """Decide to resume: the answer must be resumable and under front.max_resumes; then
        the next engine, and the request that continues the answer on it."""
        tracker = call.tracker
        refusal = tracker.resume_refusal()
        if refusal is not None:
            raise _Failed(FrontFailure.NOT_RESUMABLE, "the engine died during this answer, "
                          f"which cannot be resumed: {refusal.detail}")
        self._within_resume_limit(call.attempts)
        new = await self._recovered(call.rid, call.ready, why)
        call.path, call.body = tracker.continuation()
        call.headers[RESUME_HEADER] = str(len(tracker.out_ids))
        call.attempts += 1
        self.metrics.front_resumed.labels(endpoint=call.plan.endpoint).inc()
        log.warning("request %s: resumed on recovery %d (lost on recovery %d) after %d tokens "
                    "sent", call.rid, new.recovery, call.ready.recovery, len(tracker.out_ids))
        call.ready = new

    async def _stream_failed(self, call: _Call, e: BaseException) -> web.StreamResponse:
        """What the client gets when the front gives the stream up (or it went away)."""
        if isinstance(e, _ClientGone):
            self.metrics.front_failed.labels(reason=FrontFailure.CLIENT_GONE).inc()
            log.info("request %s: client went away", call.rid)
            assert call.resp is not None
            return call.resp
        if isinstance(e, _Failed):
            self.metrics.front_failed.labels(reason=e.reason).inc()
            log.error("request %s failed (%s): %s", call.rid, e.reason, e)
            if call.resp is None:
                return _json_error(503, str(e), retry_after=self.config.queue.retry_after_s)
            await call.resp.write(error_frame(str(e)))
            await call.resp.write_eof()
            return call.resp
        if not self._shutting_down or call.resp is None:
            raise e
        # Our own stop() ended it after the drain: say so to the client.
        self.metrics.front_failed.labels(reason=FrontFailure.DRAINING).inc()
        with contextlib.suppress(Exception):
            await call.resp.write(error_frame("the front is shutting down"))
            await call.resp.write_eof()
        return call.resp

    def _within_resume_limit(self, attempts: int) -> None:
        """_Failed when the engine died under one request more than front.max_resumes times
        (the same limit for a whole request sent again and for a stream continued)."""
        if attempts >= self.config.max_resumes:
            raise _Failed(FrontFailure.RESUME_LIMIT,
                          f"the engine died {attempts + 1} times under this request "
                          f"(front.max_resumes={self.config.max_resumes})")


@dataclass
class _Call:
    """One streaming request as the front carries it from engine to engine."""

    request: web.Request
    rid: str
    ready: Ready
    plan: Plan
    tracker: Tracker
    headers: CIMultiDict[str]
    # What goes to the engine next: the request, then the continuation.
    path: str
    body: dict[str, Any]
    resp: web.StreamResponse | None = None
    # The engine's own answer instead of a stream, for the client as it is.
    answer: web.Response | None = None
    relay: Relay | None = None
    attempts: int = 0
    # When the engine under this answer was lost (the client's stall runs from then).
    lost_at: float | None = None

    @classmethod
    def of(cls, request: web.Request, rid: str, ready: Ready, body: dict[str, Any],
           dead_marker: bytes | None) -> _Call:
        plan = Plan.of(request.path, body)
        headers = forward_headers(request.headers)
        headers["Content-Type"] = "application/json"
        # One name for the answer on every engine it goes to: an engine that kept the dead
        # one's KV finds it by this name (unique, unlike a client's X-Request-Id).
        headers[REQUEST_HEADER] = uuid.uuid4().hex
        headers.popall(RESUME_HEADER, None)  # only the front says what continues what
        return cls(request, rid, ready, plan, Tracker(plan, dead_marker), headers,
                   plan.endpoint, plan.first_body())
