"""A model vLLM cannot serve from held memory: typed refusal, the ladder falls through.

Real vLLM (CPU build) with the Pitstop plugin and a real holder, on a compressed-tensors W8A8
int8 checkpoint (`pitstop make-model --quant w8a8-int8`): vLLM 0.32's quantization method for it
cannot start from its own post-processed weights, so the plugin holds nothing and says why,
the snapshot is a full one, and after a SIGKILL the hybrid rung refuses with
`weights_outside_holder` and the full restore brings the engine back. A module of its own:
one vLLM at a time on these machines.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from agent.engines.vllm.plugin import support
from tests.agentproc import fallthroughs
from tests.conftest import cached_model
from tests.test_agent_vllm import (
    BOOT_S,
    _snapshots,
    io_uring_off,  # noqa: F401 - a module fixture, used by name
)
from tests.test_agent_vllm_hybrid import (
    _published,
    plugin_dir,  # noqa: F401 - a module fixture
)
from tests.test_agent_vllm_models import _greedy, _start, _stop

pytestmark = pytest.mark.integration


def test_a_quantization_vllm_cannot_restart_from_its_own_output_is_refused_typed(
        plugin_dir: Path, tmp_path: Path, io_uring_off: None):  # noqa: F811
    # compressed-tensors W8A8 int8: vLLM 0.32's CompressedTensorsLinearMethod does not declare
    # supports_pre_processed_weights (nor does vLLM's own weight cache serve it).
    n = _start(tmp_path, cached_model("tiny", quant="w8a8-int8"), plugin_dir)
    try:
        a = n.agent
        _published(a)
        first = _greedy(a)
        state = n.engine_rpc(support.RPC_STATE)
        assert state["held"] is None and "CompressedTensorsLinearMethod" in state["refused"], \
            state
        [snap] = _snapshots(a)
        assert snap["kind"] == "full", snap  # the weights are in the engine's own memory
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(1, timeout=BOOT_S)["last_recovery"]
        assert (rec["path"], rec["result"]) == ("full", "success"), (rec, a.log_tail(3000))
        codes = {f["path"]: f["refusal"]["code"] for f in rec["fallthroughs"]}
        assert codes.get("hybrid") == "weights_outside_holder", fallthroughs(rec)
        assert _greedy(a) == first
    finally:
        _stop(n)
