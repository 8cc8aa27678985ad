"""One-token forward calls replayed from CUDA graphs (GPU only).

The eager forward launches about 60 kernels a layer from Python, which bounds a step at
roughly 0.6 ms a layer whatever the GPU (13 ms a token at 8 GiB, 52 ms at 32 GiB on an
H200, measured): the canary after a restore paid more for that than for the restore
itself. A captured step launches as one graph. Graphs bake in the addresses of the
weights and the KV pool; both stay put across a hybrid restore (the holder's regions
are mapped back at the same addresses, and the KV pool is made again in the VA range it
keeps for the life of the process), so graphs captured before a snapshot replay after it
(their kernels' baked-in addresses point at the same memory again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Attention reads the KV slot up to a power-of-two span (at least this many positions), so
# one graph per (slot, span) serves every position below it: a handful of graphs a slot.
MIN_SPAN = 128


def span_for(position: int, max_len: int) -> int:
    """The attention span a one-token step at `position` runs over."""
    span = MIN_SPAN
    while span <= position:
        span *= 2
    return min(span, max_len)


StepFn = Callable[[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int],
                  torch.Tensor]


class GraphSteps:
    """Captures `step(token, position, kv, span)` once per (KV slot address, span) and
    replays it; the token and position live in static device tensors the graph reads.

    Example::

        graphs = GraphSteps(model.step_static, device)
        logits = graphs.run(token=42, position=17, kv=pool.slot_views(0))   # on the GPU
        graphs.clear()   # after the KV pool moved to other addresses
    """

    def __init__(self, step: StepFn, device: torch.device) -> None:
        self._step = step
        self._device = device
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
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

    def _capture(self, kv: list[tuple[torch.Tensor, torch.Tensor]],
                 span: int) -> tuple[Any, torch.Tensor]:
        # A warm-up outside the capture lets cuBLAS make its handles and workspaces first;
        # it writes the same K/V at the same position that the replay writes again.
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._step(self._token, self._position, kv, span)
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's thread may touch CUDA (held weights) while we capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(self._token, self._position, kv, span)
        return graph, out
