"""The reference engine against real vLLM (CPU build) on one model: same ids, same text, where
answers end inside a UTF-8 character, streamed and not; and the front's continuation of a
stream cut inside a character, on real vLLM.

One vLLM boot for the module (25-75 s); the reference engine is conftest's session engine.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from agent.front.resume import Plan, Tracker
from agent.front.sse import SSEParser
from tests.prereq import require
from tests.refengine_proc import Engine
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON, VllmServer, vllm_adapter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# The request: greedy, 16 tokens.
MAX_TOKENS = 16
CANDIDATES = ["The engine ran", "Ada opened", "Rain fell", "Once upon a time", "Bread needs",
              "What is", "The river", "Tomas wrote", "One, two", "The train"]

# (text or chat delta, token ids, finish reason, stop reason) of one streamed choice
Chunk = tuple[Any, list[int] | None, str | None, str | int | None]


@pytest.fixture(scope="module")
def vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    require(os.access(VLLM_PYTHON, os.X_OK),
            f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` (scripts/install-vllm.sh)")
    tmp = tmp_path_factory.mktemp("vllm")
    # float32 like the reference engine: by default vLLM runs a float32 model in bfloat16,
    # and near-equal logits then pick other tokens.
    adapter = vllm_adapter(tmp, tiny_model, args=[*CPU_ARGS, "--dtype", "float32"])
    server = VllmServer(adapter, tmp / "vllm.log")
    try:
        print(f"\nvLLM ready in {server.wait_ready():.1f}s", file=sys.stderr)
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def ends_inside(tok: Tokenizer, ids: list[int]) -> bool:
    """Whether these ids' bytes end inside a UTF-8 character (decoding shows U+FFFD last)."""
    return tok.decode(ids).endswith("\ufffd")


@pytest.fixture(scope="module")
def split_prompts(refengine: Engine, tok: Tokenizer) -> list[str]:
    """Prompts whose greedy answer's last token ends inside a character. The tiny model's
    weights are random, so they are found by asking it, in a fixed order, not pinned."""
    found = []
    for i in range(120):
        prompt = f"{CANDIDATES[i % len(CANDIDATES)]} {i}"
        _, ids, _ = complete(ref_post(refengine), prompt)
        if len(ids) == MAX_TOKENS and ends_inside(tok, ids):
            found.append(prompt)
        if len(found) == 3:
            return found
    raise AssertionError("no greedy answer of the tiny model ends inside a character")


def ref_post(engine: Engine) -> Any:
    def post(path: str, body: dict[str, Any], stream: bool = False) -> Any:
        with engine.http() as c:
            return _answer(c, path, body, stream)
    return post


def vllm_post(server: VllmServer) -> Any:
    def post(path: str, body: dict[str, Any], stream: bool = False) -> Any:
        with server.http(timeout=60.0) as c:
            return _answer(c, "http://localhost" + path, body, stream)
    return post


def _answer(c: Any, url: str, body: dict[str, Any], stream: bool) -> Any:
    if not stream:
        r = c.post(url, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    chunks: list[Chunk] = []
    with c.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    chunks.append((ch["delta"] if "delta" in ch else ch["text"],
                                   ch.get("token_ids"), ch["finish_reason"],
                                   ch.get("stop_reason")))
    return chunks


def request(prompt: str | list[int], max_tokens: int = MAX_TOKENS, **more: Any) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **more}


def complete(post: Any, prompt: str | list[int], **more: Any) -> tuple[list[int], list[int],
                                                                      str]:
    c = post("/v1/completions", request(prompt, **more))["choices"][0]
    return c["prompt_token_ids"], c["token_ids"], c["text"]


# vLLM's API server merges the outputs of a request whose reader fell behind into one chunk
# (its RequestOutputCollector), which a loaded machine provokes now and then; a merged stream
# says nothing about holding back, so it is asked again, and only a stream of one chunk per
# token is compared.
STREAM_TRIES = 8


def merged(chunks: list[Chunk]) -> bool:
    return any(ids is not None and len(ids) > 1 for _, ids, _, _ in chunks)


def both(refengine: Engine, vllm: VllmServer, body: dict[str, Any], stream: bool,
         path: str = "/v1/completions") -> Any:
    ref = ref_post(refengine)(path, body, stream)
    for _ in range(STREAM_TRIES):
        real = vllm_post(vllm)(path, body, stream)
        if not stream or not merged(real):
            return ref, real
    raise AssertionError(f"vLLM merged chunks of every one of {STREAM_TRIES} streams of {body}")


def chat(content: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def split_chats(refengine: Engine, tok: Tokenizer) -> list[str]:
    """User messages whose greedy chat answer's last token ends inside a character."""
    found = []
    for i in range(120):
        content = f"{CANDIDATES[i % len(CANDIDATES)]} {i}"
        r = ref_post(refengine)("/v1/chat/completions", chat(content))
        ids = r["choices"][0]["token_ids"]
        if len(ids) == MAX_TOKENS and ends_inside(tok, ids):
            found.append(content)
        if len(found) == 2:
            return found
    raise AssertionError("no greedy chat answer of the tiny model ends inside a character")


def test_answers_that_end_inside_a_character_are_the_same(
        refengine: Engine, vllm: VllmServer, tok: Tokenizer, split_prompts: list[str]) -> None:
    for prompt in split_prompts:
        ref, real = both(refengine, vllm, request(prompt), stream=False)
        r, v = ref["choices"][0], real["choices"][0]
        assert r["token_ids"] == v["token_ids"], prompt
        assert r["prompt_token_ids"] == v["prompt_token_ids"], prompt
        assert (r["text"], r["finish_reason"]) == (v["text"], v["finish_reason"]), prompt
        # the incomplete bytes are left out, not shown as U+FFFD
        assert ends_inside(tok, v["token_ids"])
        assert v["text"] == tok.decode(v["token_ids"]).rstrip("\ufffd")


def test_streams_hold_back_the_same_tokens_chunk_for_chunk(
        refengine: Engine, vllm: VllmServer, tok: Tokenizer, split_prompts: list[str]) -> None:
    held = 0
    for prompt in split_prompts:
        ref, real = both(refengine, vllm, request(prompt), stream=True)
        assert ref == real, prompt
        # one chunk per token; a token inside a character comes with no text
        assert [c[1] for c in real] == [[i] for c in real for i in c[1]]
        held += sum(1 for c in real if not c[0])
    assert held >= len(split_prompts)


def test_chat_answers_that_end_inside_a_character_are_the_same(
        refengine: Engine, vllm: VllmServer, tok: Tokenizer, split_chats: list[str]) -> None:
    path = "/v1/chat/completions"
    for content in split_chats:
        ref, real = both(refengine, vllm, chat(content), stream=False, path=path)
        assert ref["prompt_token_ids"] == real["prompt_token_ids"], content
        r, v = ref["choices"][0], real["choices"][0]
        assert r["token_ids"] == v["token_ids"], content
        assert r["message"]["content"] == v["message"]["content"], content
        assert v["message"]["content"] == tok.decode(v["token_ids"]).rstrip("\ufffd")
        ref, real = both(refengine, vllm, chat(content), stream=True, path=path)
        # the role chunk first (vLLM leaves token_ids out of it), then one chunk a token
        assert ref[0][0] == real[0][0] == {"role": "assistant", "content": ""}
        assert ref[1:] == real[1:], content
        assert real[-1][0] == {"content": ""}  # the last token's bytes are left out


def test_stop_strings_and_stop_tokens_are_held_and_cut_the_same(
        refengine: Engine, vllm: VllmServer, split_prompts: list[str]) -> None:
    _, ids, text = complete(vllm_post(vllm), split_prompts[0])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for more in ({"stop": [stop, "\u20ac\u20ac"]}, {"stop_token_ids": [ids[len(ids) // 2]]}):
        for stream in (False, True):
            ref, real = both(refengine, vllm, request(split_prompts[0], **more), stream)
            assert ref == real if stream else _same_answer(ref, real), (more, stream)


def _same_answer(ref: dict[str, Any], real: dict[str, Any]) -> bool:
    keys = ("text", "token_ids", "finish_reason", "stop_reason")
    return all(ref["choices"][0][k] == real["choices"][0][k] for k in keys)


def test_a_prompt_that_ends_inside_a_character_gets_the_same_odd_answer(
        refengine: Engine, vllm: VllmServer, tok: Tokenizer) -> None:
    """What a naive resume would send: prompt + tokens so far, ending inside a character.
    vLLM 0.32 (tokenizers' DecodeStream primed with that prompt) repeats the whole prompt's
    text in its first text (vLLM issue 48853); so does the reference engine. The front
    never sends such a continuation (agent/front/resume.py holds those tokens back)."""
    for i in range(120):
        prompt_ids, ids, _ = complete(ref_post(refengine), f"{CANDIDATES[i % 10]} {i}")
        # a cut inside a character that a later token of the answer completes
        cuts = [k for k in range(1, len(ids) - 1) if ends_inside(tok, ids[:k])
                and not ends_inside(tok, ids)]
        if cuts:
            break
    else:
        raise AssertionError("no greedy answer of the tiny model has a split character")
    cut = cuts[0]
    cont = request(prompt_ids + ids[:cut], max_tokens=len(ids) - cut)
    ref, real = both(refengine, vllm, cont, stream=False)
    assert _same_answer(ref, real)
    assert real["choices"][0]["token_ids"] == ids[cut:]
    whole = tok.decode(prompt_ids + ids, skip_special_tokens=True)
    assert real["choices"][0]["text"] == whole, "vLLM no longer repeats the prompt's text"


def test_the_fronts_continuation_on_vllm_gives_the_uninterrupted_text(
        vllm: VllmServer, tok: Tokenizer, split_prompts: list[str]) -> None:
    """The front's sent offset against real vLLM: a stream cut after any event, inside a
    character or not, continued the way the front asks, gives the client the same text and
    each id once (the test feeds the front's Tracker with vLLM's own bytes)."""
    for prompt, client_ids in itertools.product(split_prompts, (True, False)):
        plan = Plan.of("/v1/completions", {**request(prompt), "stream": True,
                                           "return_token_ids": client_ids})
        whole = vllm_events(vllm, plan.first_body())
        assert any(b'"text":""' in ev for ev in whole[:-3])  # a cut inside a character
        want = client_text(Tracker(plan), whole)
        for cut in range(1, len(whole) - 1):
            t = Tracker(plan)
            got = b"".join(t.feed(ev) for ev in whole[:cut])
            if t.complete:
                got += t.finished_frames()
            else:
                path, cont = t.continuation()
                t.begin_attempt()
                got += b"".join(t.feed(ev) for ev in vllm_events(vllm, cont, path))
            assert t.done and _text_and_ids(got) == want, (prompt, cut)


def vllm_events(server: VllmServer, body: dict[str, Any],
                path: str = "/v1/completions") -> list[bytes]:
    with server.http(timeout=60.0) as c, \
            c.stream("POST", "http://localhost" + path, json=body) as r:
        data = r.read()
    return [e + b"\n\n" for e in data.split(b"\n\n") if e.strip()]


def client_text(t: Tracker, events: list[bytes]) -> tuple[str, list[int]]:
    return _text_and_ids(b"".join(t.feed(ev) for ev in events))


def _text_and_ids(data: bytes) -> tuple[str, list[int]]:
    text, ids = "", []
    for ev in SSEParser().feed(data):
        if ev.data and not ev.done:
            for c in json.loads(ev.data).get("choices") or []:
                text += c["text"]
                ids += c.get("token_ids") or []
    return text, ids
