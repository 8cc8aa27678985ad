"""The generation loop: one thread runs the model for all admitted requests, a token each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agent.engines.refengine.detok import Delta, Detokenizer
from agent.engines.refengine.keptkv import kv_fingerprints
from agent.engines.refengine.kvpool import KVPool
from agent.engines.refengine.model import Llama
from agent.engines.refengine.protocol import Prefill
from agent.engines.refengine.sampling import Sampler, SamplingParams
from agent.holder.kvledger import KeptKVOutcome, Ledger, common_prefix

log = logging.getLogger("refengine")


class EngineBusy(Exception):
    """The KV pool cannot be freed: requests are still running."""


@dataclass(frozen=True)
class Admitted:
    """How a resumed request was admitted: with kept KV, or why it was prefilled again."""

    outcome: KeptKVOutcome
    kept: int          # positions whose KV came from the ledger
    detail: str = ""   # for the log: what did not match


@dataclass(frozen=True)
class Output:
    """One message from the loop to a request's handler."""

    admitted: Admitted | None = None  # first, and only for a resumed request
    delta: Delta | None = None
    finish_reason: str | None = None  # "stop" or "length" on the last Output
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass(eq=False)  # identity, not field equality: two requests may look alike
class Sequence:
    """A request as the loop sees it. `tokens` is prompt + generated; the KV slot holds
    the first `computed` of them."""

    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    detok: Detokenizer
    emit: Callable[[Output], None]
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int | None = None
    cancelled: bool = False
    finished: bool = False
    # The ledger's name for it (the front's request id, kept across resumes).
    key: str = ""
    # It continues a request an engine died under: look for its kept KV first.
    resume: bool = False
    # Prompt tokens that went through the model here (a kept-KV resume skips most).
    prefilled: int = 0
    prefill: Prefill = Prefill.CHUNKED

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class Counters:
    """Totals since start, read by the metrics collector."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    # Resumed requests by what they found in the ledger.
    resumes: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """Admits requests into free KV slots and steps every running one in turn.

    With `prefill_chunk=1` every token, prompt or generated, goes through the same
    one-token forward call at the same position, so a greedy request continued from
    prompt + its first k tokens yields exactly the tokens of the uninterrupted run.

    Example::

        sched = Scheduler(model, pool, eos_ids={1})
        sched.start()
        seq = sched.submit(prompt_ids, params, detok, loop, queue)   # outputs land in queue
    """

    def __init__(self, model: Llama, pool: KVPool, eos_ids: set[int], prefill_chunk: int = 1,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.model = model
        self.pool = pool
        self.eos_ids = eos_ids
        self.prefill_chunk = max(1, prefill_chunk)
        self.counters = Counters()
        self._kv_address = 0
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._paused = False
        self._stopping = False
        # Ledger entries an earlier life left, oldest first: slots a resumed request may
        # still claim, given to new requests only when no other slot is free, in that order
        # (the supervisor's canary comes before the resumes of the life that just died).
        self._orphans: list[int] = []
        self._thread = threading.Thread(target=self._loop, name="refengine-loop", daemon=True)

    # --- called from the server's event loop -------------------------------------------
    def start(self) -> None:
        self.pool.allocate()
        self._adopt_orphans()
        self._thread.start()

    @property
    def ledger(self) -> Ledger | None:
        return self.pool.held.ledger if self.pool.held is not None else None

    def _adopt_orphans(self) -> None:
        ledger = self.ledger
        self._orphans = ledger.occupied() if ledger is not None else []
        if self._orphans:
            log.info("kept KV: the ledger holds %d entries of an earlier engine (slots %s), "
                     "kept for their resumes", len(self._orphans), self._orphans)

    def stop(self) -> None:
        """End the loop; every request still running or waiting gets an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        with self._cond:
            for seq in self._running + list(self._waiting):
                seq.emit(Output(error="the engine is shutting down"))
            self._running.clear()
            self._waiting.clear()

    def submit(self, prompt: list[int], params: SamplingParams, detok: Detokenizer,
               loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Output],
               key: str = "", resume: bool = False,
               prefill: Prefill = Prefill.CHUNKED) -> Sequence:
        def emit(out: Output) -> None:
            # RuntimeError: the server's loop is closed, we are shutting down
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, out)

        seq = Sequence(prompt, params, Sampler(params), detok, emit, key=key, resume=resume,
                       prefill=prefill)
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        with self._cond:
            seq.cancelled = True
            if seq in self._waiting:
                self._waiting.remove(seq)
            self._cond.notify_all()

    def state(self) -> dict[str, int | bool]:
        with self._cond:
            return {
                "running": len(self._running),
                "waiting": len(self._waiting),
                "paused": self._paused,
                "kv_pool_allocated": self.pool.allocated,
                "kv_pool_bytes": self.pool.nbytes if self.pool.allocated else 0,
                "kv_slots_total": self.pool.slots,
                "kv_slots_used": self.pool.used,
                "kv_held": self.pool.held is not None,
                "kv_orphans": len(self._orphans),
            }

    def prepare(self, timeout_s: float) -> int:
        """Stop admitting, wait up to `timeout_s` for running requests, free the KV pool.
        Blocking: call it off the event loop. Raises EngineBusy (and admits again) when
        requests are still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._paused = True
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._paused = False
                    self._cond.notify_all()
                    raise EngineBusy(f"{len(self._running)} requests still running")
                self._cond.wait(left)
            self._kv_address = self.pool.address
            return self.pool.free()

    def resume(self) -> int:
        """Rebuild the KV pool and admit waiting requests again; returns bytes allocated."""
        with self._cond:
            n = self.pool.allocate()
            if n:
                self._adopt_orphans()
            if n and self.pool.address != self._kv_address and self.model.graphs:
                log.info("resume: the KV pool came back at another address; %d step graphs "
                         "dropped (captured again on use)", self.model.graphs)
                self.model.forget_graphs()
            self._paused = False
            self._cond.notify_all()
            return n

    # --- the loop thread ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._reap()
                    self._admit()
                    while not self._stopping and not self._running:
                        self._cond.wait()
                        self._reap()
                        self._admit()
                    if self._stopping:
                        return
                    batch = list(self._running)
                for seq in batch:
                    if not seq.cancelled:
                        self._step(seq)
        except BaseException as e:  # a broken engine must not look healthy
            log.exception("generation loop failed")
            with self._cond:
                for seq in self._running + list(self._waiting):
                    seq.emit(Output(error=f"engine failure: {e}"))
                self._running.clear()
                self._waiting.clear()
            if self._on_fatal is not None:
                self._on_fatal(e)

    def _admit(self) -> None:
        while self._waiting and not self._paused:
            if self._waiting[0].cancelled:
                self._waiting.popleft()
                continue
            seq = self._waiting[0]
            admitted = self._claim_kept(seq) if seq.resume else None
            if admitted is not None and admitted.outcome is KeptKVOutcome.KEPT:
                slot = seq.slot
            else:
                slot = self.pool.acquire(avoid=set(self._orphans))
                if slot is None and self._orphans:
                    # No free slot: the oldest entry an earlier life left gives way.
                    slot = self._orphans[0]
                    if not self.pool.take(slot):  # invariant: an orphan's slot is free
                        raise RuntimeError(f"KV slot {slot} is both an orphan and in use")
                if slot is None:
                    return
                if self.ledger is not None:
                    self.ledger.begin(slot, seq.key, seq.prompt, [slot])
            if slot in self._orphans:
                self._orphans.remove(slot)
            self._waiting.popleft()
            seq.slot = slot
            self._running.append(seq)
            self.counters.prompt_tokens += len(seq.prompt)
            if admitted is not None:
                o = admitted.outcome.value
                self.counters.resumes[o] = self.counters.resumes.get(o, 0) + 1
                seq.emit(Output(admitted=admitted))

    def _claim_kept(self, seq: Sequence) -> Admitted:
        """Find the resumed request's ledger entry and check it against what the client
        got; on success its slot is taken and `seq.computed` set to the kept positions.
        Anything not vouched for falls back (the request is then prefilled in full)."""
        ledger = self.ledger
        if ledger is None:
            return Admitted(KeptKVOutcome.NOT_HELD, 0, "the KV pool is not in the holder")
        found = ledger.find(seq.key)
        if isinstance(found, KeptKVOutcome):
            return Admitted(found, 0, "no valid ledger entry names this request")
        slot, e = found
        same = common_prefix(e.tokens, seq.tokens)
        if same < min(len(e.tokens), len(seq.tokens)):
            return Admitted(KeptKVOutcome.TOKENS_DIFFER, 0,
                            f"token {same} is {e.tokens[same]} in the ledger, "
                            f"{seq.tokens[same]} in the request")
        # The last token always runs: its logits pick the next one.
        kept = min(e.kv_valid, same, len(seq.tokens) - 1)
        if kept <= 0:
            return Admitted(KeptKVOutcome.NO_ENTRY, 0, "the entry has no KV written yet")
        if slot not in self._orphans or not self.pool.take(slot):
            return Admitted(KeptKVOutcome.SLOT_BUSY, 0, f"slot {slot} is in use")
        b = e.fp_block
        got = kv_fingerprints(self.pool.tensor, slot, 0, e.kv_valid, b)
        want = [*e.fingerprints, *([e.partial] if e.kv_valid % b else [])]
        bad = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
        # Blocks past `kept` are written over anyway; only those the resume reads count.
        if bad is not None and bad * b < kept:
            self.pool.release(slot)
            return Admitted(KeptKVOutcome.KV_CHANGED, 0,
                            f"positions {bad * b}..{min(e.kv_valid, bad * b + b) - 1} "
                            "changed since the ledger recorded them")
        ledger.adopt(slot, e, kept)
        seq.slot = slot
        seq.computed = kept
        return Admitted(KeptKVOutcome.KEPT, kept)

    def _reap(self) -> None:
        for seq in [s for s in self._running if s.cancelled or s.finished]:
            self._running.remove(seq)
            assert seq.slot is not None
            if self.ledger is not None:
                self.ledger.clear(seq.slot)  # done: nobody resumes it, the slot is free
            self.pool.release(seq.slot)
            seq.slot = None
        if not self._running:
            self._cond.notify_all()  # prepare() may be waiting for this

    def _step(self, seq: Sequence) -> None:
        assert seq.slot is not None
        prompt_left = len(seq.prompt) - 1 - seq.computed
        if seq.prefill is Prefill.ONE_PASS and prompt_left > 0:
            n = prompt_left + 1  # the whole rest of the prompt; its last logits pick a token
        else:
            # Prompt tokens before the last one may go in chunks; the last prompt token and
            # every generated one always go one at a time.
            n = min(self.prefill_chunk, prompt_left) if prompt_left > 0 else 1
        chunk = seq.tokens[seq.computed:seq.computed + n]
        logits = self.model.forward(chunk, seq.computed, self.pool.slot_views(seq.slot))
        before = seq.computed
        seq.computed += len(chunk)
        prompt_run = max(0, min(seq.computed, len(seq.prompt)) - before)
        seq.prefilled += prompt_run
        self.counters.prefill_tokens += prompt_run
        if seq.computed < len(seq.tokens):
            self._record(seq, before)
            return  # still in the prompt
        token = seq.sampler.sample(logits)
        seq.tokens.append(token)
        # Write-ahead: the logits are on the host, so the KV of every position up to
        # `computed` is written (on a GPU, the step is done); only now may the ledger
        # say so, and the token goes out after it.
        self._record(seq, before)
        self.counters.generation_tokens += 1
        self._emit_token(seq, token)

    def _record(self, seq: Sequence, before: int) -> None:
        ledger = self.ledger
        if ledger is None:
            return
        assert seq.slot is not None
        b = ledger.shape.fp_block
        first, last = before // b, seq.computed // b
        fps: dict[int, int] = {}
        if last > first:
            got = kv_fingerprints(self.pool.tensor, seq.slot, first * b, last * b, b)
            fps = dict(zip(range(first, last), got, strict=True))
        partial = 0
        if seq.computed % b:
            [partial] = kv_fingerprints(self.pool.tensor, seq.slot, last * b, seq.computed, b)
        ledger.record(seq.slot, seq.tokens, seq.computed, fps, partial)

    def _emit_token(self, seq: Sequence, token: int) -> None:
        # vLLM's order: the engine core ends a request on EOS, then a stop token id, then the
        # length; the detokenizer then looks for stop strings, which override the reason.
        p = seq.params
        reason: str | None = None
        stop_reason: str | int | None = None
        if token in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif seq.generated >= p.max_tokens or len(seq.tokens) >= self.pool.max_len:
            reason = "length"
        delta = seq.detok.add(token, stop_terminated=reason == "stop")
        if delta.stop_string is not None:
            reason, stop_reason = "stop", delta.stop_string
        elif reason is not None:
            delta = replace(delta, text=delta.text + seq.detok.finish())
        if reason is not None:
            seq.finished = True
            self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        # One output per token, even with no text yet: vLLM streams these too, and a client
        # (the front) learns the ids as they come.
        seq.emit(Output(delta=delta, finish_reason=reason, stop_reason=stop_reason))
