"""Real vLLM (CPU build) across two hosts through a real S3-compatible server: host A boots
vLLM once, snapshots it (full: no holder) and pushes it; host B, which never ran vLLM, pulls
the image and comes back through the full rung, answering as host A did. One vLLM boot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.agentproc import RunningAgent, agent_config, complete
from tests.prereq import require
from tests.s3_server import s3_server
from tests.snapshot_helpers import criu
from tests.test_agent_vllm import io_uring_off  # noqa: F401 - a module fixture, used by name
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
