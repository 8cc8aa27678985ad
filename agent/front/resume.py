"""The sent offset: what a streaming answer has delivered, and how to continue it elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.front.events import (
    EngineEvent,
    Tokens,
    plain_tokens,
    strip_ids,
    tokens_of,
)
from agent.front.sse import DONE_FRAME, SSEParser, data_frame, is_plain
from agent.refusal import Refusal, RefusalCode

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# OpenAI's (and vLLM's) max_tokens when a completions request names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Sampling settings that carry over from a chat request to the completions request that
# continues it; everything about messages, templates and tools is already in the prompt ids.
_CARRIED_FROM_CHAT = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "user",
    "priority",
)
_COMMA = ord(",")
# Keys the front takes over (stop strings) or that make no sense on a continuation.
_DROPPED_ON_RESUME = ("stop", "include_stop_str_in_output", "stream_options", "echo", "suffix",
                      "prompt_logprobs")

def _stops(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list):
        return tuple(s for s in value if isinstance(s, str) and s)
    return ()


@dataclass(frozen=True)
class Plan:
    """How the front serves one streaming request, decided from the request alone.

    Example::

        plan = Plan.of("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        plan.resumable, plan.first_body()["return_token_ids"]   # True, True
    """

    endpoint: str
    body: dict[str, Any]
    # Why a cut answer to this request cannot be continued; None when it can.
    refusal: Refusal | None = None
    client_ids: bool = False
    stops: tuple[str, ...] = ()
    include_stop: bool = False
    min_tokens: int = 0
    max_tokens: int | None = None
    include_usage: bool = False
    continuous_usage: bool = False

    @classmethod
    def of(cls, endpoint: str, body: dict[str, Any]) -> Plan:
        refusal = _why_not_resumable(endpoint, body)
        opts = body.get("stream_options") or {}
        if endpoint == CHAT:
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            limit = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return cls(
            endpoint=endpoint, body=body, refusal=refusal,
            client_ids=bool(body.get("return_token_ids")),
            stops=_stops(body.get("stop")) if refusal is None else (),
            include_stop=bool(body.get("include_stop_str_in_output")),
            min_tokens=int(body.get("min_tokens") or 0),
            max_tokens=int(limit) if isinstance(limit, int) else None,
            include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
            continuous_usage=bool(isinstance(opts, dict) and opts.get("continuous_usage_stats")),
        )

    @property
    def resumable(self) -> bool:
        return self.refusal is None

    def first_body(self) -> dict[str, Any]:
        """The request as first sent to the engine: with token ids asked for, and without the
        stop strings, which the front applies itself (see StopScanner for why)."""
        if not self.resumable:
            return self.body
        body = dict(self.body)
        body["return_token_ids"] = True
        if self.stops:
            body.pop("stop", None)
            body.pop("include_stop_str_in_output", None)
        return body

    @property
    def rewrites(self) -> bool:
        """Whether even the first attempt's events must be re-encoded (stop strings)."""
        return bool(self.stops)


def _why_not_resumable(endpoint: str, body: dict[str, Any]) -> Refusal | None:
    """None when a cut answer can be continued exactly from its token ids; else why not."""
    why = _unresumable_option(endpoint, body)
    return Refusal(RefusalCode.REQUEST_NOT_RESUMABLE, why) if why else None


def _unresumable_option(endpoint: str, body: dict[str, Any]) -> str:
    """The request option that stops a cut answer from being continued; "" for none."""
    if endpoint not in (COMPLETIONS, CHAT):
        return f"{endpoint} is not resumable"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "n or best_of > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    if body.get("tools") or body.get("functions"):
        return "tools: tool-call parsing lives in the engine's chat layer"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(
            body.get(k) for k in ("guided_json", "guided_regex", "guided_choice",
                                  "guided_grammar", "structured_outputs")):
        return "structured output: the grammar's state cannot be carried over"
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)) or (
            isinstance(prompt, list) and len(prompt) == 1)
        if not single or body.get("suffix") or body.get("prompt_embeds"):
            return "several prompts, a suffix or prompt embeddings"
    return ""


class StopScanner:
    """Applies stop strings to streamed text the way vLLM does, on the front's side.

    The engine cannot do it across a resume: it holds back text that might begin a stop
    string while the token ids for it are already out, and a stop string can straddle the
    cut. So the front strips `stop` from what it forwards, holds back the last
    len(longest)-1 characters itself, and ends the answer at the first match (in list
    order, as vLLM checks them) that ends in the newest text, once more than `min_tokens`
    tokens have come.

    Example::

        s = StopScanner(("\\n\\n",), include=False, min_tokens=0)
        s.feed("a\\n", 1), s.feed("\\nb", 2)   # ('a', None), ('', '\\n\\n')
    """

    def __init__(self, stops: tuple[str, ...], include: bool, min_tokens: int) -> None:
        self._stops = stops
        self._include = include
        self._min_tokens = min_tokens
        self._look = max(len(s) for s in stops) - 1  # how far back a match can begin
        self._hold = 0 if include else self._look
        self._pending = ""  # held back: not yet sent
        self._context = ""  # the last `_look` characters seen, sent or not

    def feed(self, text: str, tokens_so_far: int) -> tuple[str, str | None]:
        """The text that may go to the client now, and the stop string that matched."""
        buf = self._pending + text
        if text and tokens_so_far > self._min_tokens:
            seen = self._context + text
            off = len(self._context) - len(self._pending)  # where `buf` begins in `seen`
            for stop in self._stops:
                # Only a match ending in the new text counts, as in vLLM's check.
                i = seen.find(stop, max(0, len(seen) - len(text) - len(stop) + 1))
                if i >= 0:
                    self._pending = ""
                    end = i + len(stop) if self._include else i
                    return buf[:end - off], stop
        if self._look:
            self._context = (self._context + text)[-self._look:]
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        """The held-back text, when the answer ends for another reason."""
        rest, self._pending = self._pending, ""
        return rest


class Tracker:
    """Follows one streaming answer: forwards its events and records the sent offset.

    It turns engine bytes into client bytes (`feed`), knows whether the answer is complete
    (`done`), and builds the request that continues it on another engine (`continuation`).
    On the fast path (first attempt, no stop strings) an event's bytes go out as they came,
    less the id lists the front added; after a resume every event is rebuilt in the
    client's format with the first attempt's id, created time and model.

    The sent offset counts only tokens whose text went out. An engine sends a token's id
    as soon as it is sampled, but holds back its text while it ends inside a UTF-8
    character (vLLM and the reference engine alike); continuing from a prompt that ends
    there would be wrong: tokenizers' DecodeStream, which both engines prime with the
    prompt, then keeps no context and repeats the whole prompt's text (vLLM issue 48853,
    open as of vLLM 0.32). So such ids wait
    here: they count once an event brings text (or the answer ends), a client that asked
    for ids gets them with that event, and a cut before it makes the continuation
    generate those tokens again.

    Example::

        t = Tracker(Plan.of("/v1/completions", body))
        client_bytes = t.feed(engine_bytes)
        if not t.done and t.resume_refusal() is None:
            path, body = t.continuation()
            t.begin_attempt()   # then feed it the continuation's events
    """

    def __init__(self, plan: Plan, dead_marker: bytes | None = None) -> None:
        self.plan = plan
        self._chat = plan.endpoint == CHAT
        # Text of an error event by which the engine says it died (vLLM's EngineDeadError):
        # such an event ends the attempt like a lost connection, and is not sent.
        self._dead_marker = dead_marker
        self.engine_dead = False
        self.prompt_ids: list[int] | None = None
        # Ids whose text was sent (the sent offset); ids whose text has not come yet.
        self.out_ids: list[int] = []
        self._waiting_ids: list[int] = []
        self.header: dict[str, Any] = {}
        self.finish: str | None = None
        self.done = False
        # The front ended the answer (a stop string): the engine's request must be dropped.
        self.cut = False
        self.resumes = 0
        self.engine_error = False
        # Whether the client has been sent any event of this answer.
        self.started = False
        self._has_stop_reason = False
        self._usage_sent = False
        # Whether an event may take the fast path (`_quick`): see `_update_quick`.
        self._quick = False
        self._parser = SSEParser()
        self._scanner = (StopScanner(plan.stops, plan.include_stop, plan.min_tokens)
                         if plan.stops else None)

    # --- feeding ------------------------------------------------------------------------
    def begin_attempt(self) -> None:
        """A new upstream response starts: a half event from a dead engine is dropped, and
        tokens whose text it never sent come again from the continuation. Once the client
        has had part of the answer, what comes is the continuation (`continuation`): its
        events are rebuilt in the client's format."""
        self._parser = SSEParser()
        self._waiting_ids.clear()
        self.engine_dead = False
        if self.started:
            self.resumes += 1
            self._quick = False

    def feed(self, chunk: bytes) -> bytes:
        """Client bytes for a chunk of engine bytes."""
        if self._parser.whole(chunk):
            # The common read while tokens stream: one whole event, no split and no join.
            return b"" if self.done or self.engine_dead else self._one(chunk, plain=True)
        out: list[bytes] = []
        for raw in self._parser.frames(chunk):
            if self.done or self.engine_dead:
                break
            out.append(self._one(raw, is_plain(raw)))
        return b"".join(out)

    def _one(self, raw: bytes, plain: bool) -> bytes:
        """Client bytes for one event (`plain`: one `data:` line, see sse.is_plain)."""
        if self._quick and plain:
            # The common event of a first attempt: its bytes go on, less the front's ids.
            tokens = plain_tokens(raw, self._chat)
            if tokens is not None:
                return self._forward(raw, tokens)
        return self._event(EngineEvent(raw))

    def _count(self, ids: list[int], textless: bool) -> list[int]:
        """Record an event's ids; the ids it delivers to the client (see the class doc)."""
        if textless:
            self._waiting_ids.extend(ids)
            return []
        if self._waiting_ids:
            ids = [*self._waiting_ids, *ids]
            self._waiting_ids.clear()
        self.out_ids.extend(ids)
        return ids

    def _update_quick(self) -> None:
        # The fast path is for the first attempt without stop strings, once the prompt's ids
        # are known (the first event, which carries them, always takes the full path).
        self._quick = (self.plan.resumable and not self.plan.rewrites and not self.resumes
                       and self.prompt_ids is not None)

    def _event(self, ev: EngineEvent) -> bytes:
        if not ev.data:
            return ev.raw  # a comment or keep-alive
        if ev.data.strip() == b"[DONE]":
            self.done = True
            return self._usage_frame() + DONE_FRAME if self._rebuilding else ev.raw
        obj = ev.obj
        if obj is None:
            return ev.raw
        if "error" in obj:
            return self._error(ev)
        self.started = True
        if not self.header:
            self.header = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint")
                           if k in obj}
        if self.resumes:
            return self._resumed_event(ev)
        out = self._first_event(ev, obj)
        if not self._quick:
            self._update_quick()
        return out

    def _error(self, ev: EngineEvent) -> bytes:
        if self._dead_marker is not None and self._dead_marker in ev.data:
            # The engine died under this answer and says so before it exits: a crash to
            # hide and resume from, like a lost connection.
            self.engine_dead = True
            return b""
        # The engine refused or failed this request: its answer, not a crash to hide.
        self.started = True
        self.engine_error = True
        return ev.raw

    @property
    def _rebuilding(self) -> bool:
        return self.resumes > 0 or self.plan.rewrites

    def _first_event(self, ev: EngineEvent, obj: dict[str, Any]) -> bytes:
        chat = self.plan.endpoint == CHAT
        self._take_prompt_ids(obj, chat)
        tokens = tokens_of(ev, chat)
        if tokens is None:
            return self._choiceless(ev, obj)
        if not self.plan.resumable:
            return ev.raw  # only its [DONE] matters: without one, the client gets an error
        self._has_stop_reason = self._has_stop_reason or "stop_reason" in obj["choices"][0]
        if self._scanner is None:
            return self._forward(ev.raw, tokens, ev)
        return self._scanned(obj, tokens, chat)

    def _take_prompt_ids(self, obj: dict[str, Any], chat: bool) -> None:
        """The prompt's ids, from the first event that has them (chat: the event's,
        completions: its choice's)."""
        if self.prompt_ids is not None:
            return
        choices = obj.get("choices") or [{}]
        where = obj if chat else choices[0]
        if isinstance(where, dict) and isinstance(where.get("prompt_token_ids"), list):
            self.prompt_ids = where["prompt_token_ids"]

    def _choiceless(self, ev: EngineEvent, obj: dict[str, Any]) -> bytes:
        """An event without a choice: the usage counts."""
        if not self.plan.resumable:
            return ev.raw
        if obj.get("usage") is not None and self._rebuilding:
            return self._usage_frame()  # counts are the front's once it applies stops
        if obj.get("usage") is not None:
            self._usage_sent = True
        return strip_ids(ev.raw) if not self.plan.client_ids else ev.raw

    def _forward(self, raw: bytes, tokens: Tokens, ev: EngineEvent | None = None) -> bytes:
        """A first attempt's event without stop strings: its bytes as they came, less the
        id lists the front asked for (unless the client asked for them too)."""
        ids = self._count(tokens.ids, tokens.textless)
        self.finish = tokens.finish or self.finish
        if self.plan.client_ids:
            if ids == tokens.ids:
                return raw
            obj = (ev or EngineEvent(raw)).obj
            assert obj is not None
            obj["choices"][0]["token_ids"] = ids  # ids that waited for this event's text
            return data_frame(obj)
        if tokens.span is not None:
            # Cut ', "token_ids": [...]' out where it is the only id list (no prompt's ids).
            start, end = tokens.span
            if raw[start] == _COMMA and raw.count(b"token_ids") == 1:
                return raw[:start] + raw[end:]
        return strip_ids(raw)

    def _scanned(self, obj: dict[str, Any], tokens: Tokens, chat: bool) -> bytes:
        """A first attempt's event with stop strings: its text is what the scanner lets out."""
        ids = self._count(tokens.ids, tokens.textless)
        choice = obj["choices"][0]
        delta = choice.get("delta") if chat else None
        text = (delta or {}).get("content") if chat else choice.get("text")
        emit, stop, finish = self._scan(text or "", tokens.finish)
        if chat:
            if emit or (delta and "content" in delta):
                choice["delta"] = {**(delta or {}), "content": emit}
        else:
            choice["text"] = emit
        choice["finish_reason"] = finish
        if stop is not None and "stop_reason" in choice:
            choice["stop_reason"] = stop
        if not self.plan.client_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            obj.pop("prompt_token_ids", None)
        elif "token_ids" in choice:
            choice["token_ids"] = ids
        if obj.get("usage") is not None:
            obj["usage"] = self._usage()
        frame = data_frame(obj)
        if stop is not None:
            self.done = self.cut = True
            frame += self._usage_frame() + DONE_FRAME
        return frame

    def _scan(self, text: str, finish: str | None) -> tuple[str, str | None, str | None]:
        assert self._scanner is not None
        # min_tokens counts every token so far, those still waiting for their text too
        emit, stop = self._scanner.feed(text, len(self.out_ids) + len(self._waiting_ids))
        if stop is not None:
            finish = "stop"
        elif finish:
            emit += self._scanner.flush()
        if finish:
            self.finish = finish
        return emit, stop, finish

    def _resumed_event(self, ev: EngineEvent) -> bytes:
        """An event of a continuation (always a completions stream), in the client's format."""
        tokens = tokens_of(ev, chat=False)
        if tokens is None:
            return b""  # the engine's usage counts the wrong prompt; ours comes at [DONE]
        assert ev.obj is not None
        choice = ev.obj["choices"][0]
        text = choice.get("text") or ""
        ids = self._count(tokens.ids, tokens.textless)
        if self._scanner is not None:
            emit, stop, finish = self._scan(text, tokens.finish)
        else:
            emit, stop, finish = text, None, tokens.finish
            self.finish = finish or self.finish
        frame = data_frame(self._chunk(emit, ids, finish,
                                       stop if stop is not None else choice.get("stop_reason")))
        if stop is not None:
            self.done = self.cut = True
            frame += self._usage_frame() + DONE_FRAME
        return frame

    # --- building client events --------------------------------------------------------
    def _chunk(self, text: str, ids: list[int], finish: str | None,
               stop_reason: Any = None) -> dict[str, Any]:
        h = self.header
        if self.plan.endpoint == CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                      "logprobs": None, "finish_reason": finish}
            obj: dict[str, Any] = {"id": h.get("id"), "object": "chat.completion.chunk",
                                   "created": h.get("created"), "model": h.get("model")}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = {"id": h.get("id"), "object": "text_completion",
                   "created": h.get("created"), "model": h.get("model")}
        if self._has_stop_reason:
            choice["stop_reason"] = stop_reason
        if self.plan.client_ids:
            choice["token_ids"] = ids
        obj["choices"] = [choice]
        if self.plan.continuous_usage:
            obj["usage"] = self._usage()
        return obj

    def _usage(self) -> dict[str, int]:
        prompt = len(self.prompt_ids or ())
        done = len(self.out_ids) + len(self._waiting_ids)
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}

    def _usage_frame(self) -> bytes:
        if not self.plan.include_usage or self._usage_sent:
            return b""
        self._usage_sent = True
        h = self.header
        kind = "chat.completion.chunk" if self.plan.endpoint == CHAT else "text_completion"
        return data_frame({"id": h.get("id"), "object": kind, "created": h.get("created"),
                           "model": h.get("model"), "choices": [], "usage": self._usage()})

    # --- continuing ----------------------------------------------------------------------
    def resume_refusal(self) -> Refusal | None:
        """Why a cut answer cannot be continued; None when it can."""
        if not self.started:
            return None  # nothing sent yet: the whole request can simply go again
        if self.plan.refusal is not None:
            return self.plan.refusal
        if self.engine_error:
            return Refusal(RefusalCode.ENGINE_ERROR,
                           "the engine reported an error for this request")
        if self.prompt_ids is None:
            return Refusal(RefusalCode.NO_PROMPT_IDS, "the engine sent no prompt_token_ids "
                           "(does it support return_token_ids?)")
        return None

    def remaining(self) -> int | None:
        """Tokens still allowed, or None for 'up to the context length'."""
        if self.plan.max_tokens is None:
            return None
        return self.plan.max_tokens - len(self.out_ids)

    @property
    def complete(self) -> bool:
        """Every token of the answer was sent; only its end ([DONE], usage) was lost."""
        left = self.remaining()
        return self.started and (self.finish is not None or (left is not None and left <= 0))

    def finished_frames(self) -> bytes:
        """The end of an answer whose last token was sent before the engine died."""
        self.done = True
        frames = b""
        if self.finish is None:
            # The limit was reached but the engine died before saying so.
            self.finish = "length"
            frames += data_frame(self._chunk(
                self._scanner.flush() if self._scanner else "", [], "length"))
        return frames + self._usage_frame() + DONE_FRAME

    def continuation(self) -> tuple[str, dict[str, Any]]:
        """(path, body) that continues the answer, once `complete` and `resume_refusal` said
        so; the whole request again while nothing was sent. A query: `begin_attempt` takes
        the continuation's answer."""
        if not self.started:
            return self.plan.endpoint, self.plan.first_body()
        left = self.remaining()
        assert self.prompt_ids is not None and not self.complete
        body: dict[str, Any]
        if self.plan.endpoint == CHAT:
            body = {k: self.plan.body[k] for k in _CARRIED_FROM_CHAT if k in self.plan.body}
            body["model"] = self.plan.body.get("model")
        else:
            body = {k: v for k, v in self.plan.body.items() if k not in _DROPPED_ON_RESUME}
        body.update(prompt=self.prompt_ids + self.out_ids, stream=True, return_token_ids=True,
                    max_tokens=left)
        if self.plan.min_tokens:
            body["min_tokens"] = max(0, self.plan.min_tokens - len(self.out_ids))
        return COMPLETIONS, body
