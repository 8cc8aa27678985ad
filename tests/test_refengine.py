"""The reference engine as a real process on a Unix socket, driven by the official openai client."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.refengine_proc import Engine, run_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPTS = [
    "The engine ran",
    "Ada opened the green door of the workshop and",
    "Rain fell on the tin roof",
    "Tomas wrote three lines in his notebook:",
    "The train",
    "Bread needs flour, water, salt and",
    "What is the time?",
    "One, two, three, four,",
]


def complete_ids(engine: Engine, prompt: str | list[int], max_tokens: int,
                 **extra: Any) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, text) of a greedy completion that ignores EOS."""
    with engine.openai() as client:
        r = client.completions.create(
            model=engine.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
        )
    c = r.choices[0].model_dump()
    return c["prompt_token_ids"], c["token_ids"], c["text"]


def test_health_models_and_metrics(refengine: Engine) -> None:
    with refengine.http() as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        metrics = c.get("/metrics").text
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 512
    for name in ["refengine_requests_total", "refengine_prompt_tokens_total",
                 "refengine_generation_tokens_total", "refengine_requests_running",
                 "refengine_requests_waiting", "refengine_kv_slots_used",
                 "refengine_kv_slots_total 4.0", "refengine_kv_pool_bytes"]:
        assert name in metrics, name
    assert 'refengine_requests_total{code="200",endpoint="/v1/completions"}' in metrics


def test_completion_stream_matches_non_stream(refengine: Engine) -> None:
    with refengine.openai() as client:
        full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24,
                                         temperature=0, extra_body={"return_token_ids": True})
        chunks = list(client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    choice = full.choices[0].model_dump()
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(choice["prompt_token_ids"])
    assert full.usage.completion_tokens == len(choice["token_ids"])
    assert choice["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    parts = [c.choices[0].model_dump() for c in chunks[:-1]]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert sum((p["token_ids"] for p in parts), []) == choice["token_ids"]
    # the prompt ids come once, in the first chunk
    assert parts[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(p.get("prompt_token_ids") is None for p in parts[1:])
    assert parts[-1]["finish_reason"] == choice["finish_reason"]


def test_chat_stream_and_non_stream(refengine: Engine) -> None:
    messages = [{"role": "system", "content": "You fix engines."},
                {"role": "user", "content": "Why did the tractor stop?"}]
    with refengine.openai() as client:
        full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                              temperature=0,
                                              extra_body={"return_token_ids": True})
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True,
            extra_body={"return_token_ids": True}))
    body = full.model_dump()
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert text is not None and full.usage.completion_tokens > 0
    assert body["prompt_token_ids"][0] == 0  # the template starts with <s>
    assert full.usage.prompt_tokens == len(body["prompt_token_ids"])
    ids = body["choices"][0]["token_ids"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_dump()["prompt_token_ids"] == body["prompt_token_ids"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert sum((c.choices[0].model_dump()["token_ids"] for c in chunks), []) == ids
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_concurrent_requests_match_sequential(refengine: Engine) -> None:
    # 8 requests on 4 KV slots: half of them wait for a slot, all are interleaved per token.
    sequential = [complete_ids(refengine, p, 32) for p in PROMPTS]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda p: complete_ids(refengine, p, 32), PROMPTS))
    assert concurrent == sequential
    assert len({tuple(ids) for _, ids, _ in sequential}) == len(PROMPTS)


def test_greedy_text_varies(refengine: Engine) -> None:
    _, ids, _ = complete_ids(refengine, PROMPTS[0], 64)
    assert len(set(ids)) >= 16, ids  # random weights, but not one token over and over


def test_seeded_sampling_is_reproducible(refengine: Engine) -> None:
    def sample(seed: int) -> str:
        with refengine.openai() as client:
            r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24,
                                          temperature=0.9, top_p=0.95, seed=seed,
                                          extra_body={"ignore_eos": True})
        return r.choices[0].text

    first = sample(7)
    with ThreadPoolExecutor(max_workers=4) as pool:
        again = list(pool.map(sample, [7, 7, 8, 9]))
    assert again[:2] == [first, first]
    assert again[2] != first or again[3] != first


@pytest.mark.parametrize("k", [1, 5, 17, 39])
def test_greedy_resume_is_exact(refengine: Engine, k: int) -> None:
    n = 40
    for prompt in PROMPTS[:3]:
        prompt_ids, full, _ = complete_ids(refengine, prompt, n)
        _, head, _ = complete_ids(refengine, prompt, k)
        assert head == full[:k]
        _, tail, _ = complete_ids(refengine, prompt_ids + head, n - k)
        assert head + tail == full, (prompt, k)


def test_interrupted_stream_resumes_exactly(refengine: Engine) -> None:
    """What the front does: cut a stream, then continue from prompt + ids already sent."""
    n = 30
    prompt_ids, full, full_text = complete_ids(refengine, PROMPTS[3], n)
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": n, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    sent_ids: list[int] = []
    sent_text = ""
    with refengine.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            sent_ids += choice["token_ids"]
            sent_text += choice["text"]
            if len(sent_ids) >= 11:
                break  # the client goes away mid-stream
    _, tail, tail_text = complete_ids(refengine, prompt_ids + sent_ids, n - len(sent_ids))
    assert sent_ids + tail == full
    assert sent_text + tail_text == full_text
    # the engine freed the abandoned request's slot
    deadline = time.monotonic() + 10
    while refengine.http().get("/pitstop/state").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refengine.http().get("/pitstop/state").json()["kv_slots_used"] == 0


def test_stop_string_ends_generation(refengine: Engine) -> None:
    _, ids, text = complete_ids(refengine, PROMPTS[1], 40)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected = text[:text.find(stop)]
    with refengine.openai() as client:
        r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40,
                                      temperature=0, stop=[stop])
        streamed = list(client.completions.create(model="tiny", prompt=PROMPTS[1],
                                                  max_tokens=40, temperature=0, stop=stop,
                                                  stream=True))
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_dump()["stop_reason"] == stop
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_prepare_frees_pool_and_resume_rebuilds_it(refengine: Engine) -> None:
    expected = complete_ids(refengine, PROMPTS[4], 8)
    c = refengine.http()
    pool_bytes = c.get("/pitstop/state").json()["kv_pool_bytes"]
    assert pool_bytes > 0
    r = c.post("/pitstop/prepare", json={"timeout_s": 10})
    try:
        assert r.status_code == 200, r.text
        assert r.json()["freed_bytes"] == pool_bytes
        state = c.get("/pitstop/state").json()
        assert state["kv_pool_bytes"] == 0 and state["paused"] is True
        assert "refengine_kv_pool_bytes 0.0" in c.get("/metrics").text
        results: list[Any] = []
        t = threading.Thread(target=lambda: results.append(
            complete_ids(refengine, PROMPTS[4], 8)))
        t.start()
        time.sleep(1.0)
        assert not results, "a request was served while the KV pool was freed"
        assert c.get("/pitstop/state").json()["waiting"] == 1
    finally:
        r = c.post("/pitstop/resume")
    assert r.status_code == 200 and r.json()["allocated_bytes"] == pool_bytes
    t.join(timeout=30)
    assert results == [expected]


def test_prepare_refuses_while_a_request_runs(refengine: Engine) -> None:
    body = {"model": "tiny", "prompt": "Slow", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with refengine.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # keep it referenced: closing it would hang up
        next(lines)  # it is running
        busy = refengine.http().post("/pitstop/prepare", json={"timeout_s": 0})
    assert busy.status_code == 409
    assert "running" in busy.json()["error"]["message"]
    bad = refengine.http().post("/pitstop/prepare", json={"timeout_s": "soon"})
    assert bad.status_code == 400 and "timeout_s" in bad.json()["error"]["message"]
    assert refengine.http().get("/pitstop/state").json()["paused"] is False


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": "x" * 3000, "max_tokens": 1}, 400, "maximum context length is 512"),
        ({"prompt": "Hello", "max_tokens": 600}, 400, "maximum context length is 512"),
        ({"prompt": [1, 2, 99999]}, 400, "outside the vocabulary"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": "Hello", "n": 2}, 400, "n:"),
        ({"prompt": "Hello", "temperature": -1}, 400, "temperature"),
        ({"prompt": "Hello", "model": "gpt-9"}, 404, "gpt-9"),
        ({"max_tokens": 3}, 400, "prompt"),
    ],
)
def test_bad_completion_requests(refengine: Engine, body: dict[str, Any], status: int,
                                 needle: str) -> None:
    r = refengine.http().post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["code"] == status and err["type"]


def test_bad_requests_through_the_openai_client(refengine: Engine) -> None:
    with refengine.openai() as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "word " * 600}])
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="tiny", messages=[])
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="Hi")
    r = refengine.http().post("/v1/completions", content=b"{not json",
                              headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_engine_refuses_a_missing_model_or_a_too_long_context(tmp_path: Path,
                                                              tiny_model: Path) -> None:
    def start(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent.engines.refengine", *argv,
                               "--uds", str(tmp_path / "s.sock")],
                              capture_output=True, text=True, timeout=60)

    r = start("--model", str(tmp_path / "absent"))
    assert r.returncode == 2
    assert str(tmp_path / "absent") in r.stderr
    r = start("--model", str(tiny_model), "--max-model-len", "100000")
    assert r.returncode == 2
    assert "max_position_embeddings (2048)" in r.stderr
    r = start("--model", str(tiny_model), "--keep-kv")
    assert r.returncode == 2 and "give --holder SOCK too" in r.stderr
    r = start("--model", str(tiny_model), "--kv-lease-s", "0")
    assert r.returncode == 2 and "--kv-lease-s 0 is out of range" in r.stderr
    r = start("--model", str(tiny_model), "--prepare-stack", "0")
    assert r.returncode == 2 and "--prepare-stack takes bytes" in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_tcp_prefill_chunks_and_sigterm_mid_stream(tiny_model: Path) -> None:
    """--prefill-chunk > 1 is the fast path for long prompts; --host/--port add TCP;
    SIGTERM ends a running stream with an error event and the engine exits promptly."""
    with socket.socket() as s:  # a free loopback port (the engine binds it right after)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with run_engine(tiny_model, "--prefill-chunk", "16", "--kv-slots", "1",
                    "--host", "127.0.0.1", "--port", str(port)) as engine:
        _, ids, text = complete_ids(engine, PROMPTS[1], 16)
        models = httpx2.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        body = {"prompt": "Long", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with engine.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            engine.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        t0 = time.monotonic()
        assert engine.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10
        assert not engine.socket.exists()
    assert len(ids) == 16 and text
    assert models["data"][0]["id"] == "tiny"
    assert any("shutting down" in line for line in rest), rest[-3:]


def test_bfloat16_greedy_resume_is_exact(tiny_model: Path) -> None:
    with run_engine(tiny_model, "--dtype", "bfloat16", "--max-model-len", "256") as engine:
        assert engine.http().get("/pitstop/state").json()["dtype"] == "bfloat16"
        for prompt in PROMPTS[:2]:
            prompt_ids, full, _ = complete_ids(engine, prompt, 32)
            _, head, _ = complete_ids(engine, prompt, 13)
            _, tail, _ = complete_ids(engine, prompt_ids + head, 32 - 13)
            assert head + tail == full, prompt


def test_chat_resumes_through_completions_exactly(refengine: Engine) -> None:
    """A chat stream continues as a completion of prompt ids + ids sent, like the front does."""
    messages = [{"role": "user", "content": "Tell me about the bridge."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    with refengine.http() as c:
        full = c.post("/v1/chat/completions", json=body).json()
    prompt_ids, ids = full["prompt_token_ids"], full["choices"][0]["token_ids"]
    k = 9
    _, tail, _ = complete_ids(refengine, prompt_ids + ids[:k], 24 - k)
    assert ids[:k] + tail == ids
