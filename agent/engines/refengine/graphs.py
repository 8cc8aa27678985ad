"""One-token forward calls replayed from CUDA graphs (GPU only).

The eager forward launches about 60 kernels a layer from Python, which bounds a step at
roughly 0.6 ms a layer whatever the GPU (13 ms a token at 8 GiB, 52 ms at 32 GiB on an
H200, measured): the canary after a restore paid more for that than for the restore
itself. A captured step launches as one graph. Graphs bake in the addresses of the
weights and the KV pool; both stay put across a hybrid restore (the holder's regions
are mapped back at the same addresses, and the KV pool is made again in the VA range it
keeps for the life of the process), so graphs captured before a snapshot replay after it
(their kernels' baked-in addresses point at the same memory again).

A whole-prompt prefill from position 0 of a short prompt (the canary's: its length is
fixed) is captured too, once per (slot, length). Its graph runs the eager pass's own
kernels on the same shapes, so it must give the eager pass's bits: the capture checks it
(the warm-up is that eager pass) and, if they ever differ, prefills eagerly from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

# Attention reads the KV slot up to a power-of-two span (at least this many positions), so
# one graph per (slot, span) serves every position below it: a handful of graphs a slot.
MIN_SPAN = 128
# Prefills captured: prompts up to this many tokens, this many lengths at most (a graph
# per length; longer or rarer prompts are bound by their matmuls, not by launches).
PREFILL_MAX_TOKENS = 64
PREFILL_MAX_GRAPHS = 8


def span_for(position: int, max_len: int) -> int:
    """The attention span a one-token step at `position` runs over."""
    span = MIN_SPAN
    while span <= position:
        span *= 2
    return min(span, max_len)


KV = list[tuple[torch.Tensor, torch.Tensor]]
StepFn = Callable[[torch.Tensor, torch.Tensor, KV, int], torch.Tensor]
# prefill(tokens, kv): logits of the token after `tokens` (a device tensor) at 0..T-1.
PrefillFn = Callable[[torch.Tensor, KV], torch.Tensor]

log = logging.getLogger("refengine")


class GraphSteps:
    """Captures `step(token, position, kv, span)` once per (KV slot address, span) and
    replays it; the token and position live in static device tensors the graph reads.

    Example::

        graphs = GraphSteps(model.step_static, device)
        logits = graphs.run(token=42, position=17, kv=pool.slot_views(0))   # on the GPU
        graphs.clear()   # after the KV pool moved to other addresses
    """

    def __init__(self, step: StepFn, device: torch.device,
                 prefill: PrefillFn | None = None) -> None:
        self._step = step
        self._prefill = prefill
        self._device = device
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        # (slot address, prompt length) -> graph, its static token ids, its logits
        self._prefills: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.prefill_exact = True  # False once a captured prefill answered other bits
        self._pool = torch.cuda.graph_pool_handle()
        # One side stream for every warm-up and capture: cuBLAS keeps a workspace per
        # stream it ran on for the life of the process, and each goes into a snapshot's
        # image (with the prefill graphed too, the canary runs no cuBLAS call elsewhere).
        self._side = torch.cuda.Stream(device)

    def __len__(self) -> int:
        return len(self._graphs) + len(self._prefills)

    def clear(self) -> None:
        self._graphs.clear()
        self._prefills.clear()
        # The old pool dies with its last graph; capturing into its handle again trips an
        # assertion in torch's caching allocator (seen on torch 2.11).
        self._pool = torch.cuda.graph_pool_handle()

    def run(self, token: int, position: int,
            kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        span = span_for(position, kv[0][0].shape[1])
        self._token.fill_(token)
        self._position.fill_(position)
        key = (kv[0][0].data_ptr(), span)
        found = self._graphs.get(key)
        if found is None:
            found = self._graphs[key] = self._capture(kv, span)
        graph, out = found
        graph.replay()
        return out

    def can_prefill(self, tokens: int) -> bool:
        """Whether a prefill of `tokens` from position 0 goes through a graph."""
        return (self._prefill is not None and self.prefill_exact
                and 1 < tokens <= PREFILL_MAX_TOKENS)

    def run_prefill(self, tokens: list[int], kv: KV) -> torch.Tensor:
        """The prefill of `tokens` at positions 0..T-1 of the slot `kv`: its logits."""
        key = (kv[0][0].data_ptr(), len(tokens))
        found = self._prefills.get(key)
        if found is not None:
            graph, ids, out = found
            ids.copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=False)
            graph.replay()
            return out
        ids = torch.tensor(tokens, dtype=torch.long, device=self._device)
        prefill = self._prefill
        assert prefill is not None  # can_prefill said so
        if len(self._prefills) >= PREFILL_MAX_GRAPHS:
            return prefill(ids, kv)
        eager = self._warm_up(lambda: prefill(ids, kv))
        graph, out = self._record(lambda: prefill(ids, kv))
        graph.replay()
        if not torch.equal(out, eager):
            # Never seen; but a canary recorded by the eager pass must be answered as it.
            log.warning("a captured %d-token prefill gave other logits than the eager pass; "
                        "prompts are prefilled eagerly from now on", len(tokens))
            self.prefill_exact = False
            return eager
        self._prefills[key] = (graph, ids, out)
        return out

    def _capture(self, kv: KV, span: int) -> tuple[Any, torch.Tensor]:
        # It writes the same K/V at the same position that the replay writes again.
        self._warm_up(lambda: self._step(self._token, self._position, kv, span))
        return self._record(lambda: self._step(self._token, self._position, kv, span))

    def _warm_up(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # A run outside the capture lets cuBLAS make its handles and workspaces first.
        main = torch.cuda.current_stream(self._device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            out = fn()
        main.wait_stream(self._side)
        return out

    def _record(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's thread may touch CUDA (held weights) while we capture.
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side,
                              capture_error_mode="thread_local"):
            out = fn()
        return graph, out
