"""The canary: one forward pass for its prompt, the same greedy tokens, a versioned record."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch

from agent.config import CanaryConfig, parse_config
from agent.engines import build_adapter
from agent.engines.probe import CanaryAnswer
from agent.engines.refengine.detok import Detokenizer
from agent.engines.refengine.kvpool import KVPool
from agent.engines.refengine.model import Llama
from agent.engines.refengine.protocol import CompletionRequest, Prefill
from agent.engines.refengine.sampling import SamplingParams
from agent.engines.refengine.scheduler import Output, Scheduler
from agent.engines.refengine.tokenizer import Tokenizer
from agent.errors import EngineError
from agent.metrics import Metrics, StatusView, new_registry
from agent.store.manifest import Canary, CanaryMethod
from agent.supervisor.canary import CanaryBook, CanaryRecord
from agent.supervisor.gate import EngineGate
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.frontkit import socket_dir
from tests.refengine_proc import Engine

pytestmark = pytest.mark.timeout(240)

PROMPT = CanaryConfig().prompt
MAX_TOKENS = CanaryConfig().max_tokens


class CountingModel:
    """The real model; every forward call's token count is noted."""

    def __init__(self, model: Llama) -> None:
        self._model = model
        self.calls: list[int] = []

    def forward(self, tokens: list[int], start: int, kv: list) -> torch.Tensor:
        self.calls.append(len(tokens))
        return self._model.forward(tokens, start, kv)

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


def _generate(tiny_model: Path, tok: Tokenizer, prefill: Prefill,
              prefill_chunk: int = 1) -> tuple[list[int], list[int]]:
    """The greedy canary through a real scheduler: (its token ids, tokens per forward call)."""
    model = CountingModel(Llama.load(tiny_model, torch.device("cpu"), None))
    pool = KVPool(model.config, slots=2, max_len=128, device=model.device, dtype=model.dtype)
    sched = Scheduler(model, pool, eos_ids=set(), prefill_chunk=prefill_chunk)  # type: ignore[arg-type]
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def run() -> list[int]:
        queue: asyncio.Queue[Output] = asyncio.Queue()
        sched.submit(prompt, params, Detokenizer(tok.backend, prompt, ()),
                     asyncio.get_running_loop(), queue, prefill=prefill)
        ids: list[int] = []
        while True:
            out = await asyncio.wait_for(queue.get(), 60)
            assert out.error is None, out.error
            if out.delta is not None:
                ids.extend(out.delta.token_ids)
            if out.finish_reason is not None:
                return ids

    sched.start()
    try:
        return asyncio.run(run()), model.calls
    finally:
        sched.stop()


def test_one_pass_prefill_runs_the_whole_prompt_in_one_forward_call(
        tiny_model: Path, tok: Tokenizer) -> None:
    n = len(tok.encode(PROMPT))
    assert n > 8  # a prompt of many tokens: the passes saved are real
    _, calls = _generate(tiny_model, tok, Prefill.ONE_PASS)
    # One pass for the prompt (its last logits pick the first token), then one a token.
    assert calls == [n] + [1] * (MAX_TOKENS - 1)
    _, stepwise = _generate(tiny_model, tok, Prefill.CHUNKED)
    assert stepwise == [1] * (n + MAX_TOKENS - 1)


def test_one_pass_prefill_answers_the_token_by_token_paths_tokens(
        tiny_model: Path, tok: Tokenizer) -> None:
    one_pass, _ = _generate(tiny_model, tok, Prefill.ONE_PASS)
    stepwise, _ = _generate(tiny_model, tok, Prefill.CHUNKED)
    chunked, calls = _generate(tiny_model, tok, Prefill.CHUNKED, prefill_chunk=4)
    assert len(one_pass) == MAX_TOKENS
    assert one_pass == stepwise == chunked
    assert calls[0] == 4  # the chunked run did go in chunks


def test_the_request_field_is_the_engines_choice_of_prefill() -> None:
    assert CompletionRequest(prompt="x").prefill is Prefill.CHUNKED
    assert CompletionRequest(prompt="x", prefill="one_pass").prefill is Prefill.ONE_PASS
    with pytest.raises(ValueError, match="prefill"):
        CompletionRequest(prompt="x", prefill="all_at_once")


def test_the_engine_answers_a_one_pass_request_with_the_same_tokens(refengine: Engine) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    with refengine.http() as c:
        plain = c.post("/v1/completions", json=body)
        one_pass = c.post("/v1/completions", json={**body, "prefill": "one_pass"})
        wrong = c.post("/v1/completions", json={**body, "prefill": "all_at_once"})
    assert plain.status_code == one_pass.status_code == 200
    ids = one_pass.json()["choices"][0]["token_ids"]
    assert len(ids) == MAX_TOKENS and ids == plain.json()["choices"][0]["token_ids"]
    assert wrong.status_code == 400 and "prefill" in wrong.text


def test_a_record_without_a_method_was_made_the_engines_default_way(tmp_path: Path) -> None:
    book = CanaryBook(tmp_path / "canary.json")
    old = {"key": "k", "prompt": "p", "max_tokens": 2, "text": "ab", "token_ids": [1, 2]}
    book.path.write_text(json.dumps(old))
    assert book.load() == CanaryRecord("k", "p", 2, "ab", (1, 2), CanaryMethod.ENGINE_DEFAULT)
    rec = CanaryRecord("k", "p", 2, "ab", (1, 2), CanaryMethod.ONE_PASS_PREFILL)
    book.save(rec)
    assert book.load() == rec
    # A method this version does not know is no record at all: the next start records again.
    book.path.write_text(json.dumps({**old, "method": "speculative"}))
    assert book.load() is None


def test_a_manifest_canary_without_a_method_reads_as_the_engines_default_way() -> None:
    old = {"prompt": "p", "max_tokens": 2, "text": "ab", "token_ids": [1, 2]}
    assert Canary.model_validate_json(json.dumps(old)).method is CanaryMethod.ENGINE_DEFAULT
    new = Canary.model_validate_json(json.dumps({**old, "method": "one_pass_prefill"}))
    assert CanaryRecord.from_manifest("snapshot:x", new).to_manifest() == new
    with pytest.raises(ValueError, match="method"):
        Canary.model_validate_json(json.dumps({**old, "method": "speculative"}))


# --- the supervisor with the real reference engine ------------------------------------------

async def _start_once(tiny_model: Path, d: Path) -> str:
    """One supervisor over a cold start: the state its first start ended in."""
    cfg = parse_config(agent_config(d, tiny_model), "test")
    adapter = build_adapter(cfg)
    status = AgentStatus()
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    sup = Supervisor(config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics,
                     notifier=Notifier({}), status=status,
                     canaries=CanaryBook(d / "canary.json"), paths=[ColdStart(adapter)])
    run = asyncio.ensure_future(sup.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while status.state not in ("ready", "backoff", "failed"):
            assert not run.done(), f"the supervisor ended: {run.exception()!r}"
            assert loop.time() < deadline, f"no start finished: {status}"
            await asyncio.sleep(0.05)
        return status.state
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)


@pytest.mark.integration
def test_the_canary_is_recorded_by_one_pass_and_a_tampered_record_fails_verification(
        tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pitstop.supervisor")
    d = socket_dir()
    book = CanaryBook(d / "canary.json")
    assert asyncio.run(_start_once(tiny_model, d)) == "ready"
    rec = book.load()
    assert rec is not None and rec.method is CanaryMethod.ONE_PASS_PREFILL
    assert len(rec.token_ids) == MAX_TOKENS

    assert asyncio.run(_start_once(tiny_model, d)) == "ready"  # the record holds

    wrong = (rec.token_ids[0] + 1) % 1024
    tampered = CanaryRecord(rec.key, rec.prompt, rec.max_tokens, rec.text,
                            (wrong, *rec.token_ids[1:]), rec.method)
    book.save(tampered)
    assert asyncio.run(_start_once(tiny_model, d)) == "backoff"
    assert "not the one that was recorded" in caplog.text
    assert book.load() == tampered  # a failed check never replaces the record


@pytest.mark.integration
def test_an_older_record_is_checked_its_own_way_then_recorded_by_one_pass(
        tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pitstop.supervisor")
    d = socket_dir()
    book = CanaryBook(d / "canary.json")
    assert asyncio.run(_start_once(tiny_model, d)) == "ready"
    rec = book.load()
    assert rec is not None
    # What an older Pitstop wrote: no method (its engine fed the prompt a token at a time).
    older = {"key": rec.key, "prompt": rec.prompt, "max_tokens": rec.max_tokens,
             "text": rec.text, "token_ids": list(rec.token_ids)}

    book.path.write_text(json.dumps({**older, "token_ids": [7] * rec.max_tokens}))
    assert asyncio.run(_start_once(tiny_model, d)) == "backoff"
    assert "engine_default): this engine is not the one that was recorded" in caplog.text

    caplog.clear()
    book.path.write_text(json.dumps(older))
    assert asyncio.run(_start_once(tiny_model, d)) == "ready"
    assert "the record made by engine_default matched; recorded again by " \
           "one_pass_prefill" in caplog.text
    assert book.load() == rec


# vLLM's answer to a canary request with `prompt_logprobs: 1` (vLLM 0.32, the tiny model,
# abridged): no prediction before the first prompt token; each later position holds the
# prompt's own token at its rank and the top-1 at rank 1, which may be the same token.
VLLM_PROMPT_LOGPROBS_CHOICE = {
    "text": " c", "token_ids": [274], "prompt_token_ids": [0, 54, 280, 318],
    "prompt_logprobs": [
        None,
        {"54": {"logprob": -7.6, "rank": 652, "decoded_token": "P"},
         "238": {"logprob": -4.6, "rank": 1, "decoded_token": "x"}},
        {"280": {"logprob": -4.3, "rank": 1, "decoded_token": "it"}},
        {"318": {"logprob": -6.6, "rank": 246, "decoded_token": "st"},
         "113": {"logprob": -4.4, "rank": 1, "decoded_token": "y"}},
    ]}


def test_vllms_prompt_predictions_come_before_the_generated_token() -> None:
    answer = CanaryAnswer.from_choice(VLLM_PROMPT_LOGPROBS_CHOICE)
    assert answer == CanaryAnswer(text="xity c", token_ids=(238, 280, 113, 274))
    # Without the prompt's logprobs an answer is its generated tokens alone.
    plain = {"text": "ab", "token_ids": [1, 2]}
    assert CanaryAnswer.from_choice(plain) == CanaryAnswer(text="ab", token_ids=(1, 2))


def test_a_prompt_position_without_a_top_prediction_is_an_engine_error() -> None:
    choice = {**VLLM_PROMPT_LOGPROBS_CHOICE,
              "prompt_logprobs": [None, {"54": {"logprob": -7.6, "rank": 652}}]}
    with pytest.raises(EngineError, match="no rank-1 token"):
        CanaryAnswer.from_choice(choice)

