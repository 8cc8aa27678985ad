"""The reference engine's CUDA graph steps on a real GPU: the same greedy tokens as the eager
steps, spans crossed, and graphs kept or dropped correctly when the KV pool is rebuilt (as a
snapshot's prepare/resume does). Run on the device machine: `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from agent.engines.refengine.graphs import MIN_SPAN, span_for
from agent.engines.refengine.kvpool import KVPool
from agent.engines.refengine.model import Llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    # Skipped, not failed, without a GPU even under CI=true: the `gpu` marker keeps these
    # out of `make test`, and CI has no GPU by design.
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return torch.device("cuda")


def greedy(model: Llama, pool: KVPool, prompt: list[int], n: int) -> list[int]:
    slot = pool.acquire()
    assert slot is not None
    try:
        kv = pool.slot_views(slot)
        tokens = list(prompt)
        for i in range(len(prompt) + n - 1):
            logits = model.forward([tokens[i]], i, kv)
            if i >= len(prompt) - 1:
                tokens.append(int(logits.argmax()))
        return tokens[len(prompt):]
    finally:
        pool.release(slot)


def test_graph_steps_match_eager_steps_across_spans(tiny_model, cuda):
    eager = Llama.load(tiny_model, cuda, "float32")
    graphed = Llama.load(tiny_model, cuda, "float32", cuda_graphs=True)
    prompt = [1, 17, 42, 99, 7]
    n = MIN_SPAN + 20  # crosses from the first span into the second
    assert span_for(len(prompt) + n, 4096) == 2 * MIN_SPAN
    pools = [KVPool(m.config, 2, 512, cuda, torch.float32) for m in (eager, graphed)]
    for p in pools:
        p.allocate()
    want = greedy(eager, pools[0], prompt, n)
    got = greedy(graphed, pools[1], prompt, n)
    assert got == want
    assert graphed.graphs == 2  # one slot, two spans


def test_graphs_survive_the_kv_pool_being_freed_and_made_again(tiny_model, cuda):
    # What a snapshot's prepare and resume do: the pool comes back at the same address, so
    # the graphs captured before are replayed, not captured again.
    model = Llama.load(tiny_model, cuda, "float32", cuda_graphs=True)
    pool = KVPool(model.config, 2, 256, cuda, torch.float32)
    pool.allocate()
    first = greedy(model, pool, [3, 5, 8], 12)
    before, graphs = pool.address, model.graphs
    assert pool.free() == pool.nbytes and pool.address == 0
    pool.allocate()
    assert pool.address == before
    assert greedy(model, pool, [3, 5, 8], 12) == first
    assert model.graphs == graphs


def test_graphs_are_captured_again_after_being_dropped(tiny_model, cuda):
    model = Llama.load(tiny_model, cuda, "float32", cuda_graphs=True)
    pool = KVPool(model.config, 2, 256, cuda, torch.float32)
    pool.allocate()
    first = greedy(model, pool, [3, 5, 8], 12)
    model.forget_graphs()
    assert model.graphs == 0
    assert greedy(model, pool, [3, 5, 8], 12) == first
    assert model.graphs == 1


def one_pass(model: Llama, pool: KVPool, prompt: list[int], n: int) -> tuple[torch.Tensor,
                                                                              list[int]]:
    """The canary's way: the prompt in one forward call, then one token a call."""
    slot = pool.acquire()
    assert slot is not None
    try:
        kv = pool.slot_views(slot)
        first = model.forward(prompt, 0, kv)
        tokens = [*prompt, int(first.argmax())]
        for i in range(len(prompt), len(prompt) + n - 1):
            tokens.append(int(model.forward([tokens[i]], i, kv).argmax()))
        return first, tokens[len(prompt):]
    finally:
        pool.release(slot)


def test_a_short_prefill_is_replayed_from_a_graph_with_the_eager_passs_bits(tiny_model, cuda):
    eager = Llama.load(tiny_model, cuda, "bfloat16")
    graphed = Llama.load(tiny_model, cuda, "bfloat16", cuda_graphs=True)
    pools = [KVPool(m.config, 2, 256, cuda, torch.bfloat16) for m in (eager, graphed)]
    for p in pools:
        p.allocate()
    prompt = [1, 17, 42, 99, 7, 3, 5, 8, 13, 21, 34, 55, 89, 2, 4, 6]
    want_logits = eager.forward(prompt, 0, pools[0].slot_views(0))
    got_logits, got = one_pass(graphed, pools[1], prompt, 8)
    assert torch.equal(got_logits, want_logits)
    assert graphed.graphs == 2  # the prefill's graph and one decode span
    again_logits, again = one_pass(graphed, pools[1], prompt, 8)
    assert torch.equal(again_logits, want_logits) and again == got
    assert graphed.graphs == 2  # replayed, not captured again
    assert graphed._graphs is not None and graphed._graphs.prefill_exact
