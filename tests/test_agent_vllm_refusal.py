"""A model whose quantization cannot restart from its own output: held for the hybrid
restore.

Real vLLM (CPU build) with the Pitstop plugin and a real holder, on a compressed-tensors W8A8
int8 checkpoint (`pitstop make-model --quant w8a8-int8`): vLLM 0.32's quantization method for
it does not declare `supports_pre_processed_weights` (nor does vLLM's own weight cache serve
it). The plugin loads it with vLLM's own loader and holds what the post-processing made,
under a region name that says no fresh vLLM may attach it, and a SIGKILL comes back through
the hybrid restore. (That the warm rung refuses such a region, `weights_not_restartable`, and
that a new start replaces it: tests/test_vllm_plugin.py, with a real holder.) A module of its
own: one vLLM at a time on these machines.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from agent.engines.vllm.plugin import support
from tests.conftest import cached_model
from tests.test_agent_vllm import (
    BOOT_S,
    _manifest,
    _snapshots,
    io_uring_off,  # noqa: F401 - a module fixture, used by name
)
from tests.test_agent_vllm_hybrid import (
    _published,
    plugin_dir,  # noqa: F401 - a module fixture
)
from tests.test_agent_vllm_models import _greedy, _start, _stop

pytestmark = pytest.mark.integration


def _held_region(state: dict) -> str:
    assert state["source"] == "disk" and state["outside"] == [], state
    [region] = state["held"]["regions"]
    return region


def test_a_quantization_that_cannot_restart_from_its_output_comes_back_through_hybrid(
        plugin_dir: Path, tmp_path: Path, io_uring_off: None):  # noqa: F811
    n = _start(tmp_path, cached_model("tiny", quant="w8a8-int8"), plugin_dir)
    try:
        a = n.agent
        _published(a)
        first = _greedy(a)
        state = n.engine_rpc(support.RPC_STATE)
        region = _held_region(state)
        # vLLM's CPU int8 kernel keeps a pointer to each layer's weight scales in its oneDNN
        # handler: they stay where they are (in the image), not moved into held memory,
        # where the handler would read the freed copy (zeros, once it was given back).
        scales = [t for t in state["in_image"] if t.endswith(".weight_scale")]
        assert len(scales) == 8, state["in_image"]
        [snap] = _snapshots(a)
        assert snap["kind"] == "hybrid", (snap, a.log_tail(4000))
        digest = _manifest(a, snap["id"]).identity.weights_digest
        assert region.startswith(f"{digest}/{support.ONCE_REGION}"), region
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(1, timeout=BOOT_S)["last_recovery"]
        assert (rec["path"], rec["result"]) == ("hybrid", "success"), (rec, a.log_tail(3000))
        assert _greedy(a) == first
        # The image mapped the same held bytes back: no start attached them, none loaded.
        assert _held_region(n.engine_rpc(support.RPC_STATE)) == region
    finally:
        _stop(n)
