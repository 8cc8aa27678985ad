"""The standby rung for vLLM (CPU build, Pitstop plugin) through the real agent, real CRIU
and a real holder: one vLLM boot, its hybrid snapshot restored stopped beside it, and a
SIGKILL of its API server answered by continuing that copy."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agent.engines.vllm.plugin import support
from tests.agentproc import RunningAgent
from tests.conftest import cached_model
from tests.holder_proc import Holder
from tests.test_agent_standby import _armed
from tests.test_agent_vllm import BOOT_S, io_uring_off  # noqa: F401 - a module fixture
from tests.test_agent_vllm_hybrid import (
    ENV,
    HybridNode,
    _config,
    _greedy,
    _published,
    plugin_dir,  # noqa: F401 - a module fixture, used by name
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def node(plugin_dir: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
         io_uring_off: None) -> Iterator[HybridNode]:  # noqa: F811 - the fixture above
    model = cached_model("medium")
    tmp = tmp_path_factory.mktemp("agent-vllm-standby")
    holder = Holder(tmp / "holder")
    cfg = _config(tmp, model, {**ENV, "PYTHONPATH": str(plugin_dir)}, tmp / "holder")
    cfg["snapshots"]["standby"] = True
    a = RunningAgent(tmp, cfg)
    n = HybridNode(a, holder, model)
    try:
        a.wait_ready(timeout=BOOT_S)
        yield n
    finally:
        rc = a.stop(timeout=60)
        print(f"\nagent log tail:\n{a.log_tail(3000)}", file=sys.stderr)
        n.holder.stop()
        assert rc == 0, f"agent exited {rc}"


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def test_a_sigkill_of_vllms_api_server_is_answered_by_continuing_the_standby(node: HybridNode):
    a = node.agent
    _published(a)
    client = openai.OpenAI(base_url=a.front_url, api_key="none", timeout=BOOT_S, max_retries=0)
    before = _greedy(client)
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
    t0 = time.monotonic()
    os.kill(live, signal.SIGKILL)
    st = a.wait_recovered(restarts + 1, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("standby", "success"), (rec, a.log_tail(3000))
    assert rec["fallthroughs"] == [], rec
    # No restore after the crash: the copy was restored before it, and only continued.
    assert "criu_restore" not in rec["stages"], rec
    assert {"standby_continue", "resume", "verify"} <= set(rec["stages"]), rec
    assert st["engine_pid"] == init
    print(f"\nstandby: answered {time.monotonic() - t0:.2f}s after the SIGKILL, "
          f"recovery {rec['duration_s']:.2f}s, stages {rec['stages']}", file=sys.stderr)
    # The weights re-attached from the holder, through the engine's socket (now a link
    # into the copy's mount namespace), and the same greedy answer through the front.
    assert node.engine_rpc(support.RPC_STATE)["held"]["attached"]
    assert _greedy(client) == before
    client.close()
