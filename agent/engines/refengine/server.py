"""The aiohttp application: OpenAI-compatible endpoints plus /pitstop/* control endpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from agent.checkpoint.xcomp import request_amx_self
from agent.engines.refengine import protocol as P
from agent.engines.refengine.detok import Detokenizer
from agent.engines.refengine.footprint import describe, largest_mappings, shrink
from agent.engines.refengine.metrics import EngineCollector
from agent.engines.refengine.model import Llama
from agent.engines.refengine.sampling import SamplingParams
from agent.engines.refengine.scheduler import Admitted, EngineBusy, Output, Scheduler, Sequence
from agent.engines.refengine.tokenizer import ChatTemplateError, Tokenizer
from agent.errors import HolderError
from agent.holder.kvledger import KeptKVOutcome

if TYPE_CHECKING:
    from agent.tenant.weights import HeldWeights

log = logging.getLogger("refengine")


class ClientError(Exception):
    """A request the engine refuses; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


@dataclass(frozen=True)
class Parsed:
    req: P.CompletionRequest | P.ChatRequest
    prompt: list[int]
    params: SamplingParams


class EngineApp:
    """Routes HTTP requests to the scheduler and formats what it produces.

    Example::

        app = EngineApp(model, tokenizer, scheduler, "tiny-llama", "/models/tiny").build()
        # web.AppRunner(app) + web.UnixSite(runner, "/run/engine.sock")
    """

    def __init__(self, model: Llama, tokenizer: Tokenizer, scheduler: Scheduler,
                 served_name: str, model_dir: str, held: HeldWeights | None = None,
                 prepare_stack: int | None = None) -> None:
        self.model, self.tok, self.sched = model, tokenizer, scheduler
        self.prepare_stack = prepare_stack  # --prepare-stack: footprint.shrink
        # Weights in the holder's memory (--holder): detached by prepare, back by resume.
        self.held = held
        self.served_name, self.model_dir = served_name, model_dir
        self.max_model_len = scheduler.pool.max_len
        self.requests: Counter[tuple[str, int]] = Counter()
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(self.metrics_snapshot))
        self.created = int(time.time())

    def build(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/pitstop/prepare", self.prepare)
        app.router.add_post("/pitstop/resume", self.resume)
        app.router.add_get("/pitstop/state", self.state)
        return app

    def metrics_snapshot(self) -> dict[str, Any]:
        c = self.sched.counters
        return {**self.sched.state(), "requests": dict(self.requests),
                "finished": dict(c.finished), "prompt_tokens": c.prompt_tokens,
                "prefill_tokens": c.prefill_tokens, "resumes": dict(c.resumes),
                "generation_tokens": c.generation_tokens, "weight_bytes": self.model.weight_bytes}

    # --- plain endpoints ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.served_name, "object": "model", "created": self.created,
                "owned_by": "pitstop", "root": self.model_dir, "parent": None,
                "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response({
            **self.sched.state(), "model": self.served_name, "pid": os.getpid(),
            "device": str(self.model.device), "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len, "weight_bytes": self.model.weight_bytes,
            "prefill_tokens": self.sched.counters.prefill_tokens,
            "kv_resumes": dict(self.sched.counters.resumes),
            **self._held_state(),
        })

    def _held_state(self) -> dict[str, Any]:
        if self.held is None:
            return {"weights_source": "disk", "held": None}
        return {"weights_source": self.held.source,
                "held": {"socket": str(self.held.socket), "digest": self.held.digest,
                         "attached": self.held.attached, "bytes": self.held.nbytes,
                         "regions": self.held.identity}}

    async def prepare(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
            timeout = float(body.get("timeout_s", 10.0))
        except (ValueError, TypeError, AttributeError):
            return _error(400, 'body must be empty or a JSON object like {"timeout_s": 10}')
        try:
            freed = await asyncio.to_thread(self.sched.prepare, timeout)
        except EngineBusy as e:
            return _error(409, f"{e}; retry when they finish, or pass a longer timeout_s",
                          "ConflictError")
        log.info("prepare: KV pool freed (%d bytes); new requests wait for resume", freed)
        if self.held is not None:
            # Nothing runs now (the scheduler is paused with no request in flight), so
            # no kernel or thread reads the weights while they are unmapped.
            await asyncio.to_thread(self.held.detach)
            log.info("prepare: held weights detached (%d bytes, address range kept)",
                     self.held.nbytes)
        # Caches given back now are not dumped and not restored (footprint.py).
        footprint = await asyncio.to_thread(self._shrink)
        if self.model.device.type == "cuda":
            # What the CUDA checkpoint will move into the image besides the CUDA context's
            # own memory: the size of the image, and so of the restore, follows it.
            log.info("prepare: torch still holds %d bytes of GPU memory (%d in use: graph "
                     "pools, cuBLAS workspaces, tables); they go into a snapshot's image",
                     footprint["torch_reserved"], footprint["torch_allocated"])
        return web.json_response({"freed_bytes": freed, **self.sched.state(),
                                  **self._held_state()})

    def _shrink(self) -> dict[str, int | None]:
        cuda = self.model.device.type == "cuda"
        before = describe(self.model.device, self.model.graphs)
        t0 = time.monotonic()
        # Only a smaller image rides on it: a failure must not fail the prepare, which has
        # already unmapped the weights the agent would otherwise leave unmapped.
        try:
            trimmed = shrink(cuda, self.prepare_stack)
        except Exception as e:  # noqa: BLE001 - any failure of it is only logged
            log.warning("prepare: caches not given back: %s", e)
            return before
        spent = time.monotonic() - t0
        after = describe(self.model.device, self.model.graphs)
        log.info("prepare: %s in %.3fs", trimmed.describe(), spent)
        log.info("prepare: image footprint %s (before the caches were given back: %s)",
                 _figures(after), _figures(before))
        log.info("prepare: largest host mappings: %s", "; ".join(largest_mappings()))
        return after

    async def resume(self, request: web.Request) -> web.Response:
        # A CRIU restore loses the AMX permission torch's oneDNN asked for at start, and a
        # bf16 matmul is then SIGILL. The agent asks again from outside before the tree
        # runs; asking here too covers a restore by anything else (a repeat is harmless).
        try:
            log.info("resume: AMX permission %s", request_amx_self().value)
        except OSError as e:
            log.warning("resume: the AMX permission was refused: %s", e)
        if self.held is not None:
            try:
                await asyncio.to_thread(self.held.reattach)
            except HolderError as e:
                # The engine stays paused: serving without its weights is impossible, and
                # serving other bytes at those addresses would be wrong. The agent kills
                # it and falls to the next rung.
                log.error("resume: held weights cannot be re-attached: %s", e)
                return _error(409, f"held weights cannot be re-attached: {e}", "ConflictError")
            log.info("resume: held weights re-attached at the same addresses")
        allocated = await asyncio.to_thread(self.sched.resume)
        log.info("resume: KV pool rebuilt (%d bytes)", allocated)
        return web.json_response({"allocated_bytes": allocated, **self.sched.state(),
                                  **self._held_state()})

    # --- generation -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        endpoint = request.path
        try:
            parsed = await self._parse(request, chat)
        except ClientError as e:
            self.requests[(endpoint, e.status)] += 1
            log.info("%s %d: %s", endpoint, e.status, e.message)
            return _error(e.status, e.message, e.err_type, e.param)
        queue: asyncio.Queue[Output] = asyncio.Queue()
        detok = Detokenizer(self.tok.backend, parsed.prompt, parsed.params.stop)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        # The front names the request across engines; a resumed one says so, and how many
        # tokens of its prompt the client already has (they follow the original prompt).
        key = request.headers.get(P.REQUEST_HEADER) or rid
        resume = P.RESUME_HEADER in request.headers
        seq = self.sched.submit(parsed.prompt, parsed.params, detok,
                                asyncio.get_running_loop(), queue, key=key, resume=resume,
                                prefill=parsed.req.prefill)
        try:
            if parsed.req.stream:
                resp = await self._stream(request, parsed, seq, queue, rid, chat)
            else:
                resp = await self._collect(parsed, queue, rid, chat)
        finally:
            if not seq.finished:
                self.sched.cancel(seq)  # the client went away, or we failed: free the slot
        self.requests[(endpoint, resp.status)] += 1
        log.info("%s %s %d prompt=%d prefilled=%d generated=%d %.3fs%s", endpoint, rid,
                 resp.status, len(parsed.prompt), seq.prefilled, seq.generated,
                 time.monotonic() - t0, " stream" if parsed.req.stream else "")
        return resp

    async def _parse(self, request: web.Request, chat: bool) -> Parsed:
        try:
            body = await request.json()
        except ValueError as e:
            raise ClientError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ClientError(400, "request body must be a JSON object")
        try:
            req = (P.ChatRequest if chat else P.CompletionRequest).model_validate(body)
        except ValidationError as e:
            raise ClientError(400, _describe(e)) from None
        if req.model is not None and req.model != self.served_name:
            raise ClientError(404, f"The model `{req.model}` does not exist; this engine "
                              f"serves `{self.served_name}`.", "NotFoundError", "model")
        prompt, asked = self._prompt(req)
        self._check_ids(prompt, "prompt")
        self._check_ids(req.stop_token_ids or [], "stop_token_ids")
        params = SamplingParams(
            max_tokens=self._max_tokens(len(prompt), asked),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
        )
        return Parsed(req, prompt, params)

    def _prompt(self, req: P.ChatRequest | P.CompletionRequest) -> tuple[list[int], int | None]:
        """The prompt's token ids, and the completion tokens asked for (None: to the end)."""
        if isinstance(req, P.ChatRequest):
            try:
                text = self.tok.render_chat(req.messages, req.add_generation_prompt)
            except ChatTemplateError as e:
                raise ClientError(400, f"messages: {e}", param="messages") from None
            return (self.tok.encode(text, add_special_tokens=False),
                    req.max_completion_tokens or req.max_tokens)
        try:
            p = req.single_prompt()
        except ValueError as e:
            raise ClientError(400, str(e), param="prompt") from None
        return (self.tok.encode(p) if isinstance(p, str) else list(p)), req.max_tokens

    def _max_tokens(self, n: int, asked: int | None) -> int:
        """The completion tokens a prompt of `n` gets: `asked`, or up to the context's end."""
        limit = self.max_model_len
        if n == 0:
            raise ClientError(400, "prompt: empty; send at least one token", param="prompt")
        if n >= limit:
            raise ClientError(400, f"This model's maximum context length is {limit} tokens. "
                              f"However, your request has {n} input tokens. Please reduce "
                              "the length of the input.", param="prompt")
        if asked is None:
            return limit - n
        if n + asked > limit:
            raise ClientError(400, f"This model's maximum context length is {limit} tokens. "
                              f"However, you requested {n + asked} tokens ({n} in the "
                              f"input, {asked} in the completion). Please reduce the "
                              "length of the input or completion.", param="max_tokens")
        return asked

    def _check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ClientError(400, f"{field}: token id {bad[0]} is outside the vocabulary "
                              f"(0..{vocab - 1})", param=field)

    async def _collect(self, parsed: Parsed, queue: asyncio.Queue[Output], rid: str,
                       chat: bool) -> web.Response:
        text, ids = "", []
        while True:
            out = await queue.get()
            if out.admitted is not None:
                _log_admitted(out.admitted, parsed)
                continue
            if out.error is not None:
                return _error(500, out.error, "InternalServerError")
            if out.delta is not None:
                text += out.delta.text
                ids += out.delta.token_ids
            if out.finish_reason is not None:
                break
        want_ids = parsed.req.return_token_ids
        u = P.usage(len(parsed.prompt), len(ids))
        if chat:
            msg = {"role": "assistant", "content": text}
            choice = P.chat_choice(msg, out.finish_reason, out.stop_reason,
                                   ids if want_ids else None, stream=False)
            extra = {"prompt_token_ids": parsed.prompt} if want_ids else {}
            body = P.envelope(rid, self.served_name, True, False, [choice], usage=u, **extra)
        else:
            choice = P.completion_choice(text, out.finish_reason, out.stop_reason,
                                         ids if want_ids else None,
                                         parsed.prompt if want_ids else None)
            body = P.envelope(rid, self.served_name, False, False, [choice], usage=u)
        return web.json_response(body)

    @staticmethod
    async def _stream_headers(parsed: Parsed, seq: Sequence,
                              queue: asyncio.Queue[Output]) -> dict[str, str]:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if seq.resume:
            # Whether kept KV served it goes in the headers: the front counts it.
            out = await queue.get()
            if out.admitted is not None:
                _log_admitted(out.admitted, parsed)
                headers[P.KV_HEADER] = out.admitted.outcome.value
                headers[P.KV_KEPT_HEADER] = str(out.admitted.kept)
            else:
                queue.put_nowait(out)  # an error before admission: sent below
        return headers

    async def _stream(self, request: web.Request, parsed: Parsed, seq: Sequence,
                      queue: asyncio.Queue[Output], rid: str, chat: bool) -> web.StreamResponse:
        req = parsed.req
        want_ids = req.return_token_ids
        created = int(time.time())
        extra: dict[str, Any] = {"usage": None} if req.include_usage else {}
        resp = web.StreamResponse(headers=await self._stream_headers(parsed, seq, queue))
        await resp.prepare(request)

        async def send(choices: list[dict[str, Any]], **more: Any) -> None:
            chunk = P.envelope(rid, self.served_name, chat, True, choices, created,
                               **{**extra, **more})
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        try:
            first = True
            if chat:  # like OpenAI: a first chunk that only names the role
                ids_more = {"prompt_token_ids": parsed.prompt} if want_ids else {}
                delta = {"role": "assistant", "content": ""}
                await send([P.chat_choice(delta, None, None, [] if want_ids else None, True)],
                           **ids_more)
            generated = 0
            while True:
                out = await queue.get()
                if out.error is not None:
                    await resp.write(b"data: " + json.dumps(
                        P.error_body(out.error, 500, "InternalServerError")).encode() + b"\n\n")
                    break
                generated += len(out.delta.token_ids) if out.delta else 0
                await send([_stream_choice(out, parsed, chat, first)])
                first = False
                if out.finish_reason is not None:
                    if req.include_usage:
                        await send([], usage=P.usage(len(parsed.prompt), generated))
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            log.info("%s: client went away after %d tokens", rid, seq.generated)
        return resp


def _stream_choice(out: Output, parsed: Parsed, chat: bool, first: bool) -> dict[str, Any]:
    """The choice of one streamed chunk carrying `out`'s delta."""
    text = out.delta.text if out.delta else ""
    ids = out.delta.token_ids if out.delta else []
    tok_ids = ids if parsed.req.return_token_ids else None
    if chat:
        # {"content": ""} even on the last chunk, as vLLM sends it
        return P.chat_choice({"content": text}, out.finish_reason, out.stop_reason, tok_ids,
                             True)
    prompt_ids = parsed.prompt if parsed.req.return_token_ids and first else None
    return P.completion_choice(text, out.finish_reason, out.stop_reason, tok_ids, prompt_ids)


def _log_admitted(a: Admitted, parsed: Parsed) -> None:
    n = len(parsed.prompt)
    if a.outcome is KeptKVOutcome.KEPT:
        log.info("resume: kept KV for %d of %d positions; prefilling %d", a.kept, n, n - a.kept)
    else:
        log.warning("resume: kept KV not used (%s: %s); prefilling all %d positions",
                    a.outcome.value, a.detail, n)


def _figures(d: dict[str, int | None]) -> str:
    return " ".join(f"{k}={'?' if v is None else v}" for k, v in d.items())


def _error(status: int, message: str, err_type: str = "BadRequestError",
           param: str | None = None) -> web.Response:
    return web.json_response(P.error_body(message, status, err_type, param), status=status)


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
