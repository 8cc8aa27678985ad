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
from agent.engines.refengine.kvpool import KVPool
from agent.engines.refengine.model import Llama
from agent.engines.refengine.sampling import Sampler, SamplingParams

log = logging.getLogger("refengine")


class EngineBusy(Exception):
    """The KV pool cannot be freed: requests are still running."""


@dataclass(frozen=True)
class Output:
    """One message from the loop to a request's handler."""

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
    finished: dict[str, int] = field(default_factory=dict)


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
        self._thread = threading.Thread(target=self._loop, name="refengine-loop", daemon=True)

    # --- called from the server's event loop -------------------------------------------
    def start(self) -> None:
        self.pool.allocate()
        self._thread.start()

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
               loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Output]) -> Sequence:
        def emit(out: Output) -> None:
            # RuntimeError: the server's loop is closed, we are shutting down
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, out)

        seq = Sequence(prompt, params, Sampler(params), detok, emit)
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
            slot = self.pool.acquire()
            if slot is None:
                return
            seq = self._waiting.popleft()
            seq.slot = slot
            self._running.append(seq)
            self.counters.prompt_tokens += len(seq.prompt)

    def _reap(self) -> None:
        for seq in [s for s in self._running if s.cancelled or s.finished]:
            self._running.remove(seq)
            assert seq.slot is not None
            self.pool.release(seq.slot)
            seq.slot = None
        if not self._running:
            self._cond.notify_all()  # prepare() may be waiting for this

    def _step(self, seq: Sequence) -> None:
        assert seq.slot is not None
        # Prompt tokens before the last one may go in chunks; the last prompt token and every
        # generated one always go one at a time.
        prompt_left = len(seq.prompt) - 1 - seq.computed
        n = min(self.prefill_chunk, prompt_left) if prompt_left > 0 else 1
        chunk = seq.tokens[seq.computed:seq.computed + n]
        logits = self.model.forward(chunk, seq.computed, self.pool.slot_views(seq.slot))
        seq.computed += len(chunk)
        if seq.computed < len(seq.tokens):
            return  # still in the prompt
        token = seq.sampler.sample(logits)
        seq.tokens.append(token)
        self.counters.generation_tokens += 1
        self._emit_token(seq, token)

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
