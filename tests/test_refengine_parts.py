"""The reference engine's parts in-process: forward pass, KV pool, sampler, detokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.engines.refengine.detok import Detokenizer
from agent.engines.refengine.kvpool import KVPool
from agent.engines.refengine.model import Llama
from agent.engines.refengine.sampling import Sampler, SamplingParams
from agent.engines.refengine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Llama:
    return Llama.load(tiny_model, torch.device("cpu"), None)


def test_chunked_prefill_agrees_with_token_by_token(model: Llama) -> None:
    """The causal mask and positions of a multi-token call match one-token steps."""
    pool = KVPool(model.config, slots=2, max_len=64, device=model.device, dtype=model.dtype)
    pool.allocate()
    ids = [0, 398, 673, 602, 696, 280, 266, 474, 33, 90]
    chunked = model.forward(ids, 0, pool.slot_views(0))
    for pos, t in enumerate(ids):
        stepwise = model.forward([t], pos, pool.slot_views(1))
    assert torch.allclose(chunked, stepwise, atol=1e-4)
    # two chunks at an offset give the same answer too
    model.forward(ids[:4], 0, pool.slot_views(1))
    assert torch.allclose(model.forward(ids[4:], 4, pool.slot_views(1)), chunked, atol=1e-4)


def test_kv_pool_free_and_allocate(model: Llama) -> None:
    pool = KVPool(model.config, slots=2, max_len=32, device=model.device, dtype=model.dtype)
    assert pool.allocate() == pool.nbytes > 0
    slot = pool.acquire()
    assert slot is not None and pool.used == 1
    with pytest.raises(RuntimeError, match="in use"):
        pool.free()
    pool.release(slot)
    assert pool.free() == pool.nbytes and not pool.allocated
    assert pool.acquire() is None  # nothing is handed out while the pool is freed


def test_sampler_seed_and_greedy() -> None:
    logits = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    a = [Sampler(params).sample(logits) for _ in range(3)]
    s = Sampler(params)
    assert a[0] == a[1] == a[2] and s.sample(logits) == a[0]
    greedy = SamplingParams(max_tokens=1, temperature=0)
    assert Sampler(greedy).sample(logits) == int(torch.argmax(logits))
    top1 = SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=None)
    assert Sampler(top1).sample(logits) == int(torch.argmax(logits))


def test_detokenizer_holds_back_partial_characters_and_stop_prefixes(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    ids = tok.encode("café, the river ran. END here", add_special_tokens=False)
    d = Detokenizer(tok.decode, stop=(" END",))
    sent_text, sent_ids, stop = "", [], None
    for i in ids:
        delta = d.add(i)
        if delta is None:
            continue
        # what was released so far decodes to exactly what was sent
        sent_text += delta.text
        sent_ids += delta.token_ids
        if delta.stop_string:
            stop = delta.stop_string
            break
        assert tok.decode(sent_ids) == sent_text
        assert "\ufffd" not in sent_text
    assert stop == " END"
    assert sent_text == "café, the river ran."
    # the last token that completed the stop string is reported too
    assert tok.decode(sent_ids).startswith(sent_text + " E")


def test_detokenizer_flush_releases_the_held_back_tail(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    d = Detokenizer(tok.decode, stop=("zzz",))
    out = [d.add(i) for i in tok.encode("buzz", add_special_tokens=False)]
    held = d.flush()
    text = "".join(x.text for x in [*out, held] if x is not None)
    assert text == "buzz"
