"""Real vLLM (CPU build) across two hosts through a real S3-compatible server: host A boots
vLLM once, snapshots it (full: no holder) and pushes it; host B, which never ran vLLM, pulls
the image and comes back through the full rung, answering as host A did; then, with holders
and Pitstop's vLLM plugin, host B refills the hybrid image's held weights from its model files
by the recipe the image carries. One vLLM boot each."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agent.holder.heldcopy import COPY_DIR
from agent.holder.weightplan import PlanSource, load_plan
from tests.agentproc import RunningAgent, agent_config, complete
from tests.conftest import cached_model
from tests.holder_proc import Holder
from tests.prereq import require
from tests.s3_server import s3_server
from tests.snapshot_helpers import criu
from tests.test_agent_vllm import io_uring_off  # noqa: F401 - a module fixture, used by name
from tests.test_agent_vllm_hybrid import plugin_dir  # noqa: F401 - a module fixture, by name
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON

pytestmark = pytest.mark.integration

BOOT_S = 400  # one vLLM start on a shared 2-core machine (25-150 s seen)


def vllm_host(tmp: Path, shared: Path, model: Path, **snapshots: object) -> dict:
    tmp.mkdir()
    return agent_config(
        tmp, model,
        engine={"kind": "vllm", "python": str(VLLM_PYTHON), "served_model_name": "tiny",
                "args": CPU_ARGS, "stop_timeout_s": 20, "socket": str(shared / "vllm.sock")},
        health={"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                "start_timeout_s": BOOT_S},
        snapshots={"remote": "s3://fleet/vllm", "pull_timeout_s": 600, **snapshots})


@pytest.mark.usefixtures("io_uring_off")
def test_vllm_snapshotted_on_one_host_serves_on_another_through_a_restore(
        tiny_model: Path, tmp_path: Path):
    require(os.access(VLLM_PYTHON, os.X_OK),
            f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` (scripts/install-vllm.sh)")
    criu()
    shared = tmp_path / "shared"
    shared.mkdir()
    with s3_server(tmp_path / "aws") as server:
        server.create_bucket("fleet")
        a = RunningAgent(tmp_path / "host-a", vllm_host(tmp_path / "host-a", shared,
                                                        tiny_model, publish=True),
                         env=server.env())
        try:
            a.wait_ready(timeout=BOOT_S)
            st = a.wait_for(lambda s: (s.get("last_push") or {}).get("result") == "ok", 600,
                            "the vLLM snapshot pushed")
            pushed = st["last_push"]
            assert pushed["kind"] == "full" and pushed["bytes"] > 100e6, pushed
            answer = complete(a, "Once upon a time")
        finally:
            a.stop(timeout=60)

        b = RunningAgent(tmp_path / "host-b", vllm_host(tmp_path / "host-b", shared,
                                                        tiny_model, regenerate="manual"),
                         env=server.env())
        try:
            st = b.wait_ready(timeout=BOOT_S)
            assert st["last_pull"]["result"] == "ok", st["last_pull"]
            assert st["last_pull"]["snapshot"] == pushed["snapshot"]
            assert st["last_recovery"]["path"] == "full", (st["last_recovery"], b.log_tail())
            assert complete(b, "Once upon a time") == answer
        finally:
            b.stop(timeout=60)


@pytest.mark.usefixtures("io_uring_off")
def test_a_vllm_node_that_never_held_the_weights_refills_them_from_its_model_files(
        plugin_dir: Path, tmp_path: Path):  # noqa: F811 - the fixture imported above
    """Host A with a holder loads vLLM's parameters into it once and pushes the hybrid image,
    which carries the recipe of its held region; host B, with a fresh holder, no copy of the
    held set and the same model files, pulls it and comes back through the refill rung."""
    criu()
    model = cached_model("medium")  # bf16, as vLLM holds it: the files' bytes, relaid
    shared = tmp_path / "shared"
    shared.mkdir()

    def host(name: str, **snapshots: object) -> dict:
        cfg = vllm_host(tmp_path / name, shared, model, **snapshots)
        cfg["engine"].update(served_model_name="tiny", env={
            "PYTHONPATH": str(plugin_dir), "VLLM_CPU_KVCACHE_SPACE": "1"})
        # The fleet's one holder directory: the image holds its socket's path.
        cfg["holder"] = {"enabled": True, "dir": str(tmp_path / "holder"), "gpu": "cpu"}
        return cfg

    with s3_server(tmp_path / "aws") as server:
        server.create_bucket("fleet")
        holder = Holder(tmp_path / "holder")
        a = RunningAgent(tmp_path / "host-a", host("host-a", publish=True), env=server.env())
        try:
            a.wait_ready(timeout=BOOT_S)
            st = a.wait_for(lambda s: (s.get("last_push") or {}).get("result") == "ok", 600,
                            "the hybrid vLLM snapshot pushed")
            pushed = st["last_push"]
            assert pushed["kind"] == "hybrid", (pushed, a.log_tail(3000))
            answer = complete(a, "Once upon a time")
        finally:
            a.stop(timeout=60)
            holder.stop()

        # Host B's holder: fresh, in a directory with no plan, no copy, no layout.
        shutil.rmtree(tmp_path / "holder")
        holder = Holder(tmp_path / "holder")
        b = RunningAgent(tmp_path / "host-b", host("host-b", regenerate="manual"),
                         env=server.env())
        try:
            st = b.wait_ready(timeout=BOOT_S)
            assert st["last_pull"]["snapshot"] == pushed["snapshot"], st["last_pull"]
            assert st["last_recovery"]["path"] == "refill", (st["last_recovery"],
                                                             b.log_tail(4000))
            assert complete(b, "Once upon a time") == answer
            plan = load_plan(tmp_path / "holder" / "cpu")
            assert plan is not None and plan.source is PlanSource.RECIPE
            assert not (tmp_path / "holder" / "cpu" / COPY_DIR).exists()
        finally:
            b.stop(timeout=60)
            holder.stop()
