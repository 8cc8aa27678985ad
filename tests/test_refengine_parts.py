"""The reference engine's parts in-process: forward pass, KV pool, sampler, detokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import pre_tokenizers

from agent.engines.refengine.detok import Delta, Detokenizer
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


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: what byte-level BPE tokens spell."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in printable}
    rest = [b for b in range(256) if b not in printable]
    table.update({chr(256 + n): b for n, b in enumerate(rest)})
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    return table


def _bytes_of(tok: Tokenizer, ids: list[int]) -> bytes:
    table = _byte_table()
    return bytes(table[c] for i in ids for c in tok.backend.id_to_token(i))


def _run(d: Detokenizer, ids: list[int]) -> list[Delta]:
    return [d.add(i) for i in ids]


# Two, three and four bytes per character: every one is split over byte tokens by the tiny
# model's 1024-token vocabulary.
SPLIT = "café at 5 € — naïve 😀 done"


def test_tiny_vocabulary_splits_these_characters_over_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(SPLIT, add_special_tokens=False)
    inside = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert len(inside) >= 5, "the test text no longer splits characters"


def test_text_inside_a_character_waits_for_the_token_that_completes_it(tok: Tokenizer) -> None:
    ids = tok.encode(SPLIT, add_special_tokens=False)
    raw = _bytes_of(tok, ids)
    assert raw == SPLIT.encode()
    d = Detokenizer(tok.backend, tok.encode("The engine ran"))
    sent, n = "", 0
    for i, delta in zip(ids, _run(d, ids), strict=True):
        assert delta.token_ids == [i]  # one delta per token, text or not
        assert "\ufffd" not in delta.text
        sent += delta.text
        n += len(_bytes_of(tok, [i]))
        # exactly the complete characters of the bytes so far
        assert sent == raw[:n].decode("utf-8", "ignore")
    assert sent == SPLIT and d.finish() == ""


def test_an_answer_that_ends_inside_a_character_leaves_its_bytes_out(tok: Tokenizer) -> None:
    ids = tok.encode("hot 😀", add_special_tokens=False)
    for cut in range(1, len(ids)):
        d = Detokenizer(tok.backend, [0])
        text = "".join(x.text for x in _run(d, ids[:cut])) + d.finish()
        assert text == _bytes_of(tok, ids[:cut]).decode("utf-8", "ignore"), cut
        assert not text.endswith("\ufffd")


def test_bytes_that_can_never_complete_show_as_u_fffd_once_text_follows(
        tok: Tokenizer) -> None:
    # A lone continuation byte (0x80) is invalid wherever it stands; like vLLM, it is held
    # only while it is last, then shown as U+FFFD.
    lone = next(i for i in range(tok.vocab_size) if _bytes_of(tok, [i]) == b"\x80")
    ids = [lone, *tok.encode(" ok", add_special_tokens=False)]
    d = Detokenizer(tok.backend, [0])
    texts = [x.text for x in _run(d, ids)]
    assert texts[0] == "" and "".join(texts) == "\ufffd ok"


def test_a_prompt_that_ends_inside_a_character_is_repeated_like_vllm_does(
        tok: Tokenizer) -> None:
    """tokenizers' DecodeStream (0.23) keeps no context from a prompt whose text ends in an
    incomplete character, so the first text it releases starts at the prompt's beginning.
    vLLM 0.32 primes the same stream with the prompt and answers so too (vLLM issue 48853);
    this is why the front never continues a stream from such a prompt."""
    ids = tok.encode("Once there was €5", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    d = Detokenizer(tok.backend, ids[:cut])
    text = "".join(x.text for x in _run(d, ids[cut:]))
    assert text == "Once there was €5"
    # from a prompt that ends between characters, only the new text comes
    whole = cut + next(k for k in range(1, len(ids) - cut)
                       if not tok.decode(ids[:cut + k]).endswith("\ufffd"))
    d = Detokenizer(tok.backend, ids[:whole])
    assert "".join(x.text for x in _run(d, ids[whole:])) == tok.decode(ids)[len(
        tok.decode(ids[:whole])):]


def test_stop_strings_hold_back_their_length_less_one_and_cut_the_text(
        tok: Tokenizer) -> None:
    ids = tok.encode("the river ran € END here", add_special_tokens=False)
    d = Detokenizer(tok.backend, [0], stop=(" END", "€ E"))
    released, last = "", None
    for i in ids:
        last = d.add(i)
        released += last.text
        if last.stop_string is not None:
            break
        # while running, the last 3 characters (the longest stop string less one) wait
        assert released == d.text[:max(0, len(d.text) - 3)]
    # '€ E' completes before ' END' does: the first to complete wins, and the text ends
    # where it begins
    assert last is not None and last.stop_string == "€ E"
    assert released == d.text == "the river ran "
    d = Detokenizer(tok.backend, [0], stop=("zzz",))
    running = "".join(x.text for x in _run(d, tok.encode("buzz", add_special_tokens=False)))
    assert running == "bu" and d.finish() == "zz"


def test_a_stop_token_adds_no_text(tok: Tokenizer) -> None:
    ids = tok.encode("one two", add_special_tokens=False)
    d = Detokenizer(tok.backend, [0])
    texts = [x.text for x in _run(d, ids[:-1])]
    last = d.add(ids[-1], stop_terminated=True)
    assert last.token_ids == [ids[-1]] and last.text == ""
    assert "".join(texts) + d.finish() == tok.decode(ids[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_the_sign_in_the_table_gives_hf_rotate_halfs_bits(model: Llama,
                                                                   dtype: torch.dtype) -> None:
    # The canary's recorded tokens depend on these bits: the folded sign must be exact.
    half = model.config.head_dim // 2
    cos = model._cos[:9]
    sin = torch.cat([-model._sin_signed[:9, :half], model._sin_signed[:9, half:]], dim=-1)
    x = torch.randn(6, 9, model.config.head_dim, generator=torch.Generator().manual_seed(3))
    x = x.to(dtype)
    xf = x.float()
    hf = (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(dtype)
    assert torch.equal(model._rope(x, cos, model._sin_signed[:9]), hf)


def test_the_prepare_footprint_names_the_host_memory_by_kind_and_the_largest_mappings() -> None:
    from agent.engines.refengine.footprint import describe, largest_mappings, shrink

    shrink(cuda=False)
    got = describe(torch.device("cpu"), None)
    assert got["host_anon"] and got["host_anon"] > 0 and got["host_file"] is not None
    assert "torch_reserved" not in got  # GPU figures only on a GPU
    top = largest_mappings(3)
    assert len(top) == 3 and any("[heap]" in m or "[anon]" in m for m in top)
    assert all(" dirty " in m and "MB" in m for m in top)
