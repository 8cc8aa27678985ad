"""The holder rungs through the real agent: hybrid restore, and the ladder without a holder."""

from __future__ import annotations

import os
import signal

import pytest

from tests.agentproc import complete, fallthroughs, held_agent, snapshot_list
from tests.holder_proc import Holder, wait_for
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required

pytestmark = pytest.mark.integration


@pytest.fixture
def held(tmp_path, tiny_model):
    """A cpu-backend holder and an agent whose engine keeps its weights in it."""
    with held_agent(tmp_path, tiny_model) as agent_and_holder:
        yield agent_and_holder


def test_a_cold_start_fills_the_holder_and_a_crash_comes_back_through_a_hybrid_restore(held):
    a, holder = held
    before = complete(a)
    assert holder.stats().bytes_held > 0
    [snap] = snapshot_list(a)
    assert snap["kind"] == "hybrid"
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    st = a.wait_recovered(1)
    rec = st["last_recovery"]
    assert rec["path"] == "hybrid", (rec, a.log_tail(3000))
    assert "criu_restore" in rec["stages"] and "resume" in rec["stages"]
    assert complete(a) == before
    assert "held weights re-attached at the same addresses" in a.log()


def test_without_the_holder_the_ladder_falls_through_with_its_reasons(held):
    a, holder = held
    holder.stop()
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    st = a.wait_recovered(1)
    rec = st["last_recovery"]
    assert rec["path"] == "cold", rec
    falls = " | ".join(fallthroughs(rec))
    assert "hybrid skipped: holder at" in falls and "does not answer" in falls
    assert "warm skipped: holder at" in falls
    codes = {(f["path"], f["kind"]): f["refusal"]["code"] for f in rec["fallthroughs"]}
    assert codes["hybrid", "skipped"] == codes["warm", "skipped"] == "holder_down", codes
    assert complete(a)


def test_a_restarted_holder_makes_the_hybrid_image_stale_and_a_warm_start_refills_it(
        held, tmp_path):
    a, holder = held
    holder.stop()
    # Without its refill plan the holder cannot load the weights again by itself.
    plan = tmp_path / "holder" / "cpu" / "refill.json"
    wait_for(plan.exists, "the refill plan the agent leaves")
    plan.unlink()
    fresh = Holder(tmp_path / "holder")  # a new holder: another id, nothing held
    try:
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(1)
        rec = st["last_recovery"]
        falls = " | ".join(fallthroughs(rec))
        assert "hybrid skipped" in falls and "gone" in falls, rec
        assert "refill skipped: no refill plan" in falls
        assert "warm skipped: the holder holds no committed weights" in falls
        codes = {(f["path"], f["kind"]): f["refusal"]["code"] for f in rec["fallthroughs"]}
        assert codes["hybrid", "skipped"] == "held_stale", codes
        assert codes["warm", "skipped"] == "weights_not_held", codes
        # The cold rung starts the engine with the holder, which it fills; then a fresh
        # hybrid snapshot is taken against the new holder's regions.
        assert rec["path"] == "cold"
        assert fresh.stats().bytes_held > 0
        st = a.wait_for(lambda s: s["restarts"] == 1 and "published" in s.get("reason", ""),
                        120, "the fresh snapshot")
        os.kill(st["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(2)
        assert st["last_recovery"]["path"] == "hybrid", st["last_recovery"]
    finally:
        fresh.stop()
