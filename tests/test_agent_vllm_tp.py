"""A tensor-parallel vLLM engine through the real agent: real vLLM (CPU build) with two
workers (one core each), the Pitstop plugin, real CRIU, a real holder (memfd backend).

One agent for the module and two vLLM boots: the first start, in which each worker loads
its shard from disk into a held set of its own rank, then a hybrid snapshot of the whole
tree with both sets left out; a SIGKILL of the API server comes back through the hybrid
restore, each worker attaching its own set again; then, the snapshots deleted, a SIGKILL
comes back through a warm start in which both workers attach their rank's set and read
nothing from disk. Every answer is the first start's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from agent.engines.vllm.plugin import support
from agent.weights import WeightsDigester
from tests.agentproc import RunningAgent, agent_config, fallthroughs
from tests.holder_proc import Holder
from tests.prereq import require
from tests.test_agent_vllm import (
    BOOT_S,
    _manifest,
    _prerequisites,
    _snapshots,
    io_uring_off,  # noqa: F401 - a module fixture, used by name
)
from tests.test_agent_vllm_hybrid import (
    _published,
    plugin_dir,  # noqa: F401 - a module fixture
)
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON

pytestmark = pytest.mark.integration

NAME = "tiny-tp"
PROMPT = "Once upon a time"
TP = 2
# vLLM's CPU build binds each worker's OpenMP threads to cores of its own: one each.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


class TpNode:
    """The agent, its holder, and the first start's answer."""

    def __init__(self, agent: RunningAgent, holder: Holder, model: Path) -> None:
        self.agent = agent
        self.holder = holder
        self.model = model
        self.first_answer = ""

    def worker_states(self) -> list[dict]:
        """The plugin's state in each worker, rank 0 first, asked on the engine's own socket."""
        sock = Path(self.agent.config["paths"]["state_dir"]) / "run" / "engine.sock"
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
            r = c.post("http://engine/collective_rpc", json={"method": support.RPC_STATE})
        r.raise_for_status()
        return r.json()["results"]


@pytest.fixture(scope="module")
def node(
    plugin_dir: Path,  # noqa: F811 - the fixture imported above
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    io_uring_off: None,  # noqa: F811 - the fixture imported above
) -> Iterator[TpNode]:
    _prerequisites()
    require((os.cpu_count() or 1) >= TP, f"{TP} vLLM CPU workers need {TP} cores")
    tmp = tmp_path_factory.mktemp("agent-vllm-tp")
    holder = Holder(tmp / "holder")
    cfg = agent_config(
        tmp,
        tiny_model,
        engine={
            "kind": "vllm",
            "python": str(VLLM_PYTHON),
            "served_model_name": NAME,
            "args": [*CPU_ARGS, "--tensor-parallel-size", str(TP)],
            "stop_timeout_s": 20,
            "env": {**ENV, "PYTHONPATH": str(plugin_dir)},
        },
        health={
            "interval_s": 1.0,
            "timeout_s": 5.0,
            "failures_before_restart": 3,
            "start_timeout_s": BOOT_S,
        },
        front={"queue": {"deadline_s": BOOT_S}, "resume_wait_s": BOOT_S},
        # On, so that the rungs and the snapshot policy are what they would be on a node.
        snapshots={"enabled": True, "regenerate": "after-serving"},
        holder={"enabled": True, "dir": str(tmp / "holder"), "gpu": "cpu"},
    )
    a = RunningAgent(tmp, cfg)
    n = TpNode(a, holder, tiny_model)
    t0 = time.monotonic()
    try:
        a.wait_ready(timeout=BOOT_S)
        print(f"\nagent + vLLM (TP {TP}) ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        yield n
    finally:
        rc = a.stop(timeout=60)
        print(f"\nagent log tail:\n{a.log_tail(3000)}", file=sys.stderr)
        holder.stop()
        assert rc == 0, f"agent exited {rc}"


@pytest.fixture
def client(node: TpNode) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=node.agent.front_url, api_key="none", timeout=BOOT_S, max_retries=0)
    yield c
    c.close()


def _greedy(client: openai.OpenAI) -> str:
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text


def _codes(rec: dict) -> dict[str, str]:
    return {f["path"]: f["refusal"]["code"] for f in rec["fallthroughs"]}


def _rank_keys(node: TpNode) -> list[str]:
    digest = WeightsDigester(None).digest(node.model).digest
    return [support.held_key(digest, TP, r) for r in range(TP)]


def test_the_first_start_holds_each_workers_shard_under_its_rank_then_a_hybrid_image(
    node: TpNode, client: openai.OpenAI
):
    a = node.agent
    st = _published(a)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("cold", "success"), rec
    codes = _codes(rec)
    assert codes["refill"] == "tensor_parallel", fallthroughs(rec)
    assert codes["warm"] == "weights_not_held", fallthroughs(rec)
    node.first_answer = _greedy(client)
    states = node.worker_states()
    # Each worker loaded its own shard from disk into a set of its own, every tensor held.
    assert [s["held"]["digest"] for s in states] == _rank_keys(node), states
    assert all(s["source"] == "disk" and s["outside"] == [] for s in states), states
    committed = sorted(r.name.split("/")[0] for r in node.holder.client().list() if r.committed)
    assert committed == _rank_keys(node), committed
    # The image leaves both sets out and records both as what a restore must find held.
    [snap] = _snapshots(a)
    assert snap["kind"] == "hybrid", snap
    held = _manifest(a, snap["id"]).held
    assert sorted(name.split("/")[0] for name in held) == _rank_keys(node), held


def test_a_sigkill_comes_back_through_the_hybrid_restore_of_both_workers(
    node: TpNode, client: openai.OpenAI
):
    a = node.agent
    pid = a.status()["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    st = a.wait_recovered(1, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("hybrid", "success"), (rec, a.log_tail(3000))
    assert rec["fallthroughs"] == [] and st["engine_pid"] == pid, rec
    print(
        f"\nhybrid restore of TP {TP} in {rec['duration_s']:.2f}s, stages {rec['stages']}",
        file=sys.stderr,
    )
    states = node.worker_states()
    assert all(s["held"]["attached"] for s in states) and len(states) == TP, states
    assert _greedy(client) == node.first_answer


def test_with_no_image_both_workers_attach_their_ranks_weights_and_read_nothing_from_disk(
    node: TpNode, client: openai.OpenAI
):
    a = node.agent
    snapdir = Path(a.config["paths"]["state_dir"]) / "snapshots"
    for entry in snapdir.iterdir():
        if not entry.name.startswith("."):
            shutil.rmtree(entry)
    restarts = a.status()["restarts"]
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    st = a.wait_recovered(restarts + 1, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("warm", "success"), (rec, a.log_tail(3000))
    print(
        f"\nwarm start of TP {TP} in {rec['duration_s']:.2f}s, stages {rec['stages']}",
        file=sys.stderr,
    )
    states = node.worker_states()
    assert [s["source"] for s in states] == ["holder"] * TP, states
    assert all(s["held"]["attached"] and s["outside"] == [] for s in states), states
    # Each worker's loader said so, naming its rank's region.
    attached = re.findall(
        r"attached held weights \S+\+tp2\.rank(\d)/vllm-params-\S+ "
        r"\([\d.]+ MB\): nothing read from disk",
        a.log(),
    )
    assert sorted(attached) == [str(r) for r in range(TP)], attached
    assert _greedy(client) == node.first_answer
