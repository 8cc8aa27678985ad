"""vLLM's hybrid and warm rungs through the real agent: real vLLM (CPU build) with the Pitstop
plugin, real CRIU, a real holder (memfd backend) keeping the weights.

One agent for the module and two vLLM boots: the first start, which loads the weights from
disk into the holder and takes a hybrid snapshot (the weights and the KV pool left out),
then a warm start that attaches them. Between the two, SIGKILL of the API server and of the
engine core each come back through the hybrid restore, answering as the first start did, and
after the holder is restarted empty, through the refill from the model files by the recipe the
agent had made of the held set; and when the holder is replaced while a snapshot is taken, so
that vLLM cannot map its weights again after the dump, the engine is replaced from that very
snapshot. A last test starts a vLLM without the plugin (a third boot) for a full image of the
same model.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from agent.engines.vllm.plugin import support
from agent.holder.heldcopy import COPY_DIR
from agent.holder.weightplan import PLAN_NAME, PlanSource, load_plan
from tests.agentproc import REPO, RunningAgent, Traffic, agent_config, fallthroughs
from tests.conftest import cached_model, module_scratch
from tests.holder_proc import Holder, wait_for
from tests.test_agent_standby import _armed, _children, _run_state
from tests.test_agent_vllm import (
    BOOT_S,
    _api_server,
    _engine_core,
    _manifest,
    _prerequisites,
    _shm_files,
    _snapshots,
    _sweeps,
    _swept,
    io_uring_off,  # noqa: F401 - a module fixture, used by name
)
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON

pytestmark = pytest.mark.integration

NAME = "medium"
PROMPT = "Once upon a time"
# The tests' medium Llama (185 MB of bf16 weights): far above the few MB by which two dumps of
# one engine differ anyway. A KV pool of a known size (GiB), the same in both images.
KV_GIB = 1
ENV = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Pitstop plugin installed for vLLM's interpreter, into a folder of its own: the
    shared vLLM venv stays untouched; the engine finds it on PYTHONPATH."""
    _prerequisites()
    target = tmp_path_factory.mktemp("vllm-plugin")
    subprocess.run([str(REPO / "scripts" / "install-vllm-plugin.sh"), str(VLLM_PYTHON),
                    str(target)], check=True, cwd=REPO)
    assert (target / "agent" / "engines" / "vllm" / "plugin" / "loader.py").is_file()
    return target


def _config(tmp: Path, model: Path, env: dict[str, str], holder: Path | None) -> dict:
    return agent_config(
        tmp, model,
        engine={"kind": "vllm", "python": str(VLLM_PYTHON), "served_model_name": NAME,
                "args": CPU_ARGS, "stop_timeout_s": 20, "env": env},
        health={"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                "start_timeout_s": BOOT_S},
        front={"queue": {"deadline_s": BOOT_S}, "resume_wait_s": BOOT_S},
        snapshots={"enabled": True, "regenerate": "after-serving"},
        holder=({"enabled": True, "dir": str(holder), "gpu": "cpu"} if holder
                else {"enabled": False}),
    )


class HybridNode:
    """The agent, its holder and its model."""

    def __init__(self, agent: RunningAgent, holder: Holder, model: Path) -> None:
        self.agent = agent
        self.holder = holder
        self.model = model
        self.first_answer = ""
        self.first_image = 0
        self.weight_bytes = 0

    def engine_rpc(self, method: str) -> dict:
        """The plugin's worker extension, asked on the engine's own socket (never the front)."""
        sock = self.agent.config["engine"].get("socket") or str(
            Path(self.agent.config["paths"]["state_dir"]) / "run" / "engine.sock")
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=60) as c:
            r = c.post("http://engine/collective_rpc", json={"method": method})
        r.raise_for_status()
        [result] = r.json()["results"]
        return result


@pytest.fixture(scope="module")
def node(plugin_dir: Path, request: pytest.FixtureRequest,
         io_uring_off: None) -> Iterator[HybridNode]:  # noqa: F811 - the fixture above
    model = cached_model("medium")
    with module_scratch(request, "agent-vllm-hybrid") as tmp:
        holder = Holder(tmp / "holder")
        cfg = _config(tmp, model, {**ENV, "PYTHONPATH": str(plugin_dir)}, tmp / "holder")
        a = RunningAgent(tmp, cfg)
        t0 = time.monotonic()
        n = HybridNode(a, holder, model)
        try:
            a.wait_ready(timeout=BOOT_S)
            print(f"\nagent + vLLM (plugin) ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
            yield n
        finally:
            rc = a.stop(timeout=60)
            print(f"\nagent log tail:\n{a.log_tail(3000)}", file=sys.stderr)
            n.holder.stop()  # the one serving now: a test restarts it
            assert rc == 0, f"agent exited {rc}"


@pytest.fixture
def client(node: HybridNode) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=node.agent.front_url, api_key="none", timeout=BOOT_S,
                      max_retries=0)
    yield c
    c.close()


def _greedy(client: openai.OpenAI) -> str:
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text


def _published(agent: RunningAgent, after: float = 0.0) -> dict:
    return agent.wait_for(lambda s: s.get("state") == "ready"
                          and "published" in s.get("reason", "")
                          and s.get("state_since", 0) > after, 300, "a published snapshot")


def test_the_first_start_loads_the_weights_into_the_holder_and_snapshots_without_them(
        node: HybridNode, client: openai.OpenAI):
    st = _published(node.agent)
    assert st["last_recovery"]["path"] == "cold", st["last_recovery"]
    node.first_answer = _greedy(client)
    [snap] = _snapshots(node.agent)
    assert snap["kind"] == "hybrid", (snap, node.agent.log_tail(4000))
    node.first_image = snap["image_bytes"]
    m = _manifest(node.agent, snap["id"])
    [(region, held)] = m.held.items()
    assert region.startswith(f"{m.identity.weights_digest}/vllm-params-"), region
    # Loaded from disk by vLLM's own weight loaders, straight into held memory: no parameter
    # was left outside it after vLLM's post-processing.
    state = node.engine_rpc(support.RPC_STATE)
    assert state["source"] == "disk" and state["outside"] == [], state
    assert state["held"]["attached"] and state["held"]["regions"] == m.held
    node.weight_bytes = state["held"]["bytes"]
    [committed] = [r for r in node.holder.client().list() if r.committed]
    assert committed.name == region and committed.size >= 0.9 * state["held"]["bytes"]


def _hybrid_back(node: HybridNode, client: openai.OpenAI, n: int, causes: tuple[str, ...]) -> dict:
    st = node.agent.wait_recovered(n, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("hybrid", "success"), (rec, node.agent.log_tail(3000))
    assert rec["cause"] in causes and rec["fallthroughs"] == [], rec
    assert {"criu_restore", "resume", "verify"} <= set(rec["stages"]), rec
    print(f"\nrecovery {n} ({rec['cause']}): hybrid restore in {rec['duration_s']:.2f}s, "
          f"stages {rec['stages']}", file=sys.stderr)
    # The weights came back from the holder at the addresses the image expects.
    state = node.engine_rpc(support.RPC_STATE)
    assert state["held"]["attached"], state
    assert _greedy(client) == node.first_answer
    return st


def test_sigkill_of_the_api_server_comes_back_through_the_hybrid_restore(
        node: HybridNode, client: openai.OpenAI):
    pid = node.agent.status()["engine_pid"]
    os.kill(_api_server(pid), signal.SIGKILL)  # the root ends as its child ended
    st = _hybrid_back(node, client, 1, ("crash",))
    assert st["engine_pid"] == pid  # CRIU gives the tree its PIDs back


def test_sigkill_of_the_engine_core_comes_back_through_the_hybrid_restore(
        node: HybridNode, client: openai.OpenAI):
    os.kill(_engine_core(node.agent.status()["engine_pid"]), signal.SIGKILL)
    _hybrid_back(node, client, 2, ("crash", "hang"))


def test_a_holder_restarted_empty_is_refilled_from_the_model_files_then_the_image_restored(
        node: HybridNode, client: openai.OpenAI):
    # vLLM's held set is its parameters, not the files' bytes: the refill plan is the recipe
    # the agent made of the files once the set was committed (checked against its bytes),
    # and no copy of the set was written.
    a = node.agent
    directory = node.holder.sock.parent
    wait_for(lambda: (directory / PLAN_NAME).exists(), "the refill plan", timeout=120)
    plan = load_plan(directory)
    assert plan is not None and plan.source is PlanSource.RECIPE, plan
    assert not (directory / COPY_DIR).exists()
    [(region, _)] = _manifest(a, _snapshots(a)[0]["id"]).held.items()
    assert [r.name for r in plan.regions] == [region]
    recoveries = a.status()["restarts"]
    node.holder.stop()
    node.holder = Holder(node.holder.base, "--no-refill")  # a new holder, nothing held
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    rec = a.wait_recovered(recoveries + 1, timeout=BOOT_S)["last_recovery"]
    assert (rec["path"], rec["result"]) == ("refill", "success"), (rec, a.log_tail(3000))
    assert "hybrid skipped" in " | ".join(fallthroughs(rec)), rec
    assert {"refill", "criu_restore", "resume"} <= set(rec["stages"]), rec
    print(f"\nrefill + hybrid restore in {rec['duration_s']:.2f}s, stages {rec['stages']}",
          file=sys.stderr)
    assert node.engine_rpc(support.RPC_STATE)["held"]["attached"]
    assert _greedy(client) == node.first_answer


def test_a_resume_that_fails_after_the_snapshot_replaces_vllm_from_that_snapshot(
        node: HybridNode, client: openai.OpenAI):
    a = node.agent
    # What the holder is refilled from once it is replaced (see the test above).
    wait_for(lambda: (node.holder.sock.parent / PLAN_NAME).exists(), "the refill plan", 120)
    recoveries = a.status()["restarts"]
    taken = a.metric('pitstop_snapshots_created_total{kind="hybrid",result="success"}')
    # Another holder, empty: the weights vLLM maps are gone from under it, so the plugin's
    # attach after the dump fails, as when the holder restarts while a snapshot is taken.
    node.holder.stop()
    node.holder = Holder(node.holder.base, "--no-refill")
    with Traffic(lambda: _greedy(client)) as traffic:
        r = a.pitstop("snapshot", "create", "--json", timeout=BOOT_S)
        failed_at = time.monotonic()
        st = a.wait_recovered(recoveries + 1, timeout=BOOT_S)
    assert r.returncode == 0, (r.stderr, a.log_tail(3000))
    done = json.loads(r.stdout)
    assert done["kind"] == "hybrid", done
    assert "vLLM could not map its held weights again" in done["engine_failed"], done
    rec = st["last_recovery"]
    assert (rec["cause"], rec["path"], rec["result"]) == ("resume_failed", "refill", "success"), \
        (rec, a.log_tail(3000))
    # Back from the snapshot just taken, verified by the canary the cold start recorded.
    assert f"restored snapshot {done['id']} as PID" in a.log()
    assert "verify" in rec["stages"] and node.engine_rpc(support.RPC_STATE)["held"]["attached"]
    said = [x.said for x in traffic.answers]
    assert said and all(s == node.first_answer for s in said), said
    assert traffic.spanning(failed_at), "no request was held across the failed resume"
    assert a.metric('pitstop_snapshots_created_total{kind="hybrid",result="success"}') \
        == taken + 1
    assert a.metric('pitstop_engine_failures_total{cause="resume_failed"}') == 1


def test_with_no_image_a_warm_start_attaches_the_held_weights_instead_of_reading_disk(
        node: HybridNode, client: openai.OpenAI):
    a = node.agent
    # No image to restore: the ladder must start vLLM fresh, and the weights are held.
    snapdir = Path(a.config["paths"]["state_dir"]) / "snapshots"
    for entry in snapdir.iterdir():
        if not entry.name.startswith("."):
            shutil.rmtree(entry)
    before = time.time()
    recoveries = a.status()["restarts"]
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    st = a.wait_recovered(recoveries + 1, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("warm", "success"), (rec, a.log_tail(3000))
    falls = " | ".join(fallthroughs(rec))
    assert "hybrid skipped: no snapshot" in falls and "full skipped: no snapshot" in falls, falls
    # The loader attached the committed set: no weight was read from disk.
    state = node.engine_rpc(support.RPC_STATE)
    assert state["source"] == "holder" and state["outside"] == [], state
    assert "attached held weights" in (Path(a.tmp) / "agent.log").read_text()
    assert _greedy(client) == node.first_answer
    # ... and it takes the hybrid image it lacked, against the same held set.
    _published(a, after=before)
    [snap] = _snapshots(a)
    assert snap["kind"] == "hybrid", snap


def test_the_dev_endpoints_the_plugin_needs_are_not_reachable_through_the_front(
        node: HybridNode):
    # The engine runs with VLLM_SERVER_DEV_MODE=1 on its private socket; a client of the
    # front must not reach /collective_rpc (it would detach the weights under live traffic).
    url = f"http://{node.agent.status()['front']}"
    with httpx.Client(timeout=30) as c:
        for path in ("/collective_rpc", "/sleep", "/wake_up", "/reset_prefix_cache"):
            r = c.post(url + path, json={"method": support.RPC_DETACH})
            assert r.status_code == 404, (path, r.status_code, r.text[:200])
    assert node.engine_rpc(support.RPC_STATE)["held"]["attached"]


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def test_with_snapshots_standby_a_sigkill_is_answered_by_continuing_a_copy_made_before_it(
        node: HybridNode):
    # The same node with the standby on (a key read at start): its first start restores the
    # hybrid image the last test published, and a copy of it is restored, stopped, beside it.
    node.agent.stop(timeout=60)
    a = node.agent = RunningAgent(node.agent.tmp, {
        **node.agent.config, "snapshots": {**node.agent.config["snapshots"], "standby": True}})
    a.wait_ready(timeout=BOOT_S)
    client = openai.OpenAI(base_url=a.front_url, api_key="none", timeout=BOOT_S, max_retries=0)
    before = _greedy(client)
    assert before == node.first_answer
    init, ns_init = _armed(a, timeout=BOOT_S)
    # The copy has its own loopback (vLLM's workers listen on 127.0.0.1 ports the live
    # engine holds) and its own /dev/shm (the live engine's ring buffers stay its own).
    live = a.status()["engine_pid"]
    for kind in ("net", "mnt", "pid_for_children"):
        assert _ns(ns_init, kind) != _ns(live, kind), kind
    theirs = f"/proc/{ns_init}/root/dev/shm"
    assert os.stat(theirs).st_dev != os.stat("/dev/shm").st_dev
    assert any(n.startswith("psm_") for n in os.listdir(theirs)), os.listdir(theirs)
    # ... and the live engine, its ring buffers not written over, still answers.
    assert _greedy(client) == before
    restarts = a.status()["restarts"]
    dead, sweeps = _shm_files(live), _sweeps(a, live)
    os.kill(live, signal.SIGKILL)
    st = a.wait_recovered(restarts + 1, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("standby", "success"), (rec, a.log_tail(3000))
    # The copy maps files of the same names in its own /dev/shm: the dead tree's, in the
    # host's, are removed all the same.
    _swept(a, live, dead, sweeps)
    copy = _shm_files(init, theirs)
    assert any(n.startswith("psm_") for n in set(dead) & set(copy)), (dead, copy)
    assert rec["fallthroughs"] == [], rec
    # No restore after the crash: the copy was restored before it, and only continued.
    assert "criu_restore" not in rec["stages"], rec
    assert {"standby_continue", "resume", "verify"} <= set(rec["stages"]), rec
    assert st["engine_pid"] == init
    # The weights re-attached from the holder, through the engine's socket (now a link
    # into the copy's mount namespace), and the same greedy answer through the front.
    assert node.engine_rpc(support.RPC_STATE)["held"]["attached"]
    assert _greedy(client) == before
    client.close()


def test_a_standby_woken_ahead_runs_vllm_before_the_crash_and_answers_it(node: HybridNode):
    # snapshots.standby_woken: the copy is continued as soon as it is restored (on a GPU its
    # CUDA state is restored too, locked); vLLM's processes then idle in their namespaces.
    node.agent.stop(timeout=60)
    a = node.agent = RunningAgent(node.agent.tmp, {
        **node.agent.config, "snapshots": {**node.agent.config["snapshots"], "standby": True,
                                           "standby_woken": True}})
    a.wait_ready(timeout=BOOT_S)
    client = openai.OpenAI(base_url=a.front_url, api_key="none", timeout=BOOT_S, max_retries=0)
    before = _greedy(client)
    init, ns_init = _armed(a, timeout=BOOT_S, how="woken")
    copy = [p for root in _children(ns_init) for p in [root, *_children(root)]]
    assert len(copy) >= 2 and all(_run_state(p) != "T" for p in copy), [
        (p, _run_state(p)) for p in copy]
    # Running beside it, the copy takes nothing from the live engine.
    assert _greedy(client) == before
    restarts, dead = a.status()["restarts"], a.status()["engine_pid"]
    os.kill(dead, signal.SIGKILL)
    st = a.wait_recovered(restarts + 1, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("standby", "success"), (rec, a.log_tail(3000))
    assert "criu_restore" not in rec["stages"] and st["engine_pid"] == init, rec
    # vLLM's KV pool is its own and this host has no GPU: the copy served while the dead
    # tree was still being torn down.
    assert f"engine {dead}: its tree is torn down while the standby rung is tried" in a.log()
    assert node.engine_rpc(support.RPC_STATE)["held"]["attached"]
    assert _greedy(client) == before
    client.close()


def test_a_full_image_of_the_same_model_is_larger_by_the_weights_and_the_kv_pool(
        node: HybridNode, plugin_dir: Path, tmp_path: Path):
    # vLLM without the plugin (not on its path): the rungs that need it say why, and the
    # snapshot holds everything. One vLLM at a time on this machine.
    node.agent.stop(timeout=60)
    cfg = _config(tmp_path, node.model, ENV, tmp_path / "holder")
    holder = Holder(tmp_path / "holder")
    a = RunningAgent(tmp_path, cfg)
    try:
        st = _published(a)
        falls = " | ".join(fallthroughs(st["last_recovery"]))
        assert f"vLLM cannot map held weights: the Pitstop plugin is not installed in " \
               f"vLLM's interpreter {VLLM_PYTHON}" in falls, falls
        assert {f["refusal"]["code"] for f in st["last_recovery"]["fallthroughs"]
                if f["path"] in ("hybrid", "warm")} == {"plugin_not_installed"}
        [snap] = _snapshots(a)
        assert snap["kind"] == "full", snap
        full = snap["image_bytes"]
    finally:
        a.stop(timeout=60)
        holder.stop()
    weights, kv = node.weight_bytes, KV_GIB << 30
    print(f"\nimages: full {full / 1e6:.1f} MB, hybrid {node.first_image / 1e6:.1f} MB; "
          f"weights {weights / 1e6:.1f} MB, KV pool {kv / 1e6:.1f} MB", file=sys.stderr)
    # The hybrid image left out exactly those two: the weights (in the holder) and the KV
    # pool (dropped before the dump), give or take what two dumps of one engine differ by.
    assert abs(full - node.first_image - (weights + kv)) < weights / 3, \
        (full, node.first_image, weights, kv)
