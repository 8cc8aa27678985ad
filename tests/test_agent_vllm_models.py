"""The models users serve through vLLM's holder rungs: a mixture of experts and FP8 weights.

Real vLLM (CPU build) with the Pitstop plugin, real CRIU, a real holder (memfd backend), one
agent per model (`pitstop make-model --arch qwen3-moe`, `--quant fp8`): the holder keeps what
vLLM's post-processing made of the checkpoint (repacked expert stacks, FP8 weights and their
scales, buffers), a SIGKILL comes back through the hybrid restore and, with no image, a warm
start maps the held set and reads no weight from disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agent.engines.vllm.plugin import support
from tests.agentproc import RunningAgent
from tests.conftest import cached_model, module_scratch
from tests.holder_proc import Holder
from tests.test_agent_vllm import (
    BOOT_S,
    _manifest,
    _snapshots,
    io_uring_off,  # noqa: F401 - a module fixture, used by name
)
from tests.test_agent_vllm_hybrid import (
    ENV,
    NAME,
    PROMPT,
    HybridNode,
    _config,
    _published,
    plugin_dir,  # noqa: F401 - a module fixture, used by name
)

pytestmark = pytest.mark.integration

# make-model arguments of each model the holder serves on vLLM's CPU build.
# FP8 is not here: vLLM 0.32's CPU build runs it only with AMX (docs/vllm.md, limits).
HELD = {"qwen3-moe": {"arch": "qwen3-moe"}}


def _start(tmp: Path, model: Path, plugin: Path) -> HybridNode:
    holder = Holder(tmp / "holder")
    a = RunningAgent(tmp, _config(tmp, model, {**ENV, "PYTHONPATH": str(plugin)}, tmp / "holder"))
    t0 = time.monotonic()
    a.wait_ready(timeout=BOOT_S)
    print(f"\nagent + vLLM ({model.name}) ready in {time.monotonic() - t0:.1f}s",
          file=sys.stderr)
    return HybridNode(a, holder, model)


def _stop(n: HybridNode) -> None:
    rc = n.agent.stop(timeout=60)
    print(f"\nagent log tail:\n{n.agent.log_tail(3000)}", file=sys.stderr)
    n.holder.stop()
    assert rc == 0, f"agent exited {rc}"


@pytest.fixture(scope="module", params=sorted(HELD))
def node(request: pytest.FixtureRequest, plugin_dir: Path,  # noqa: F811
         io_uring_off: None,  # noqa: F811
         ) -> Iterator[HybridNode]:
    model = cached_model("tiny", **HELD[request.param])
    with module_scratch(request, f"agent-vllm-{request.param}") as tmp:
        n = _start(tmp, model, plugin_dir)
        try:
            yield n
        finally:
            _stop(n)


def _greedy(agent: RunningAgent) -> str:
    with openai.OpenAI(base_url=agent.front_url, api_key="none", timeout=BOOT_S,
                       max_retries=0) as c:
        r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text


def test_the_first_start_holds_what_vllm_post_processing_made(node: HybridNode):
    st = _published(node.agent)
    assert st["last_recovery"]["path"] == "cold", st["last_recovery"]
    node.first_answer = _greedy(node.agent)
    [snap] = _snapshots(node.agent)
    assert snap["kind"] == "hybrid", (snap, node.agent.log_tail(4000))
    m = _manifest(node.agent, snap["id"])
    [(region, _)] = m.held.items()
    assert region.startswith(f"{m.identity.weights_digest}/vllm-params-"), region
    # Every parameter and buffer the engine reads is a view of held memory: the repacked
    # expert stacks, the FP8 weights and their scales, the rotary tables.
    state = node.engine_rpc(support.RPC_STATE)
    assert state["source"] == "disk" and state["outside"] == [], state
    assert state["held"]["attached"] and state["held"]["regions"] == m.held


def test_sigkill_comes_back_through_the_hybrid_restore_with_the_canary_equal(
        node: HybridNode):
    a = node.agent
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    rec = a.wait_recovered(1, timeout=BOOT_S)["last_recovery"]
    assert (rec["path"], rec["result"]) == ("hybrid", "success"), (rec, a.log_tail(3000))
    assert {"criu_restore", "resume", "verify"} <= set(rec["stages"]), rec
    print(f"\n{node.model.name}: hybrid restore in {rec['duration_s']:.2f}s", file=sys.stderr)
    assert node.engine_rpc(support.RPC_STATE)["held"]["attached"]
    assert _greedy(a) == node.first_answer


def test_with_no_image_a_warm_start_maps_the_held_set_and_reads_no_weight(node: HybridNode):
    a = node.agent
    snapdir = Path(a.config["paths"]["state_dir"]) / "snapshots"
    for entry in snapdir.iterdir():
        if not entry.name.startswith("."):
            shutil.rmtree(entry)
    recoveries = a.status()["restarts"]
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    rec = a.wait_recovered(recoveries + 1, timeout=BOOT_S)["last_recovery"]
    assert (rec["path"], rec["result"]) == ("warm", "success"), (rec, a.log_tail(3000))
    # vLLM rebuilt only its Python-side state over the held tensors: nothing from disk,
    # nothing the first start's post-processing made left out.
    state = node.engine_rpc(support.RPC_STATE)
    assert state["source"] == "holder" and state["outside"] == [], state
    log = (Path(a.tmp) / "agent.log").read_text()
    assert "attached held weights" in log and "were not in the held set" not in log
    assert _greedy(a) == node.first_answer
