"""The holder rungs through the real agent: hybrid restore, no holder, a failed resume."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from tests.agentproc import Traffic, complete, fallthroughs, held_agent, snapshot_list
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
    a.logged("held weights re-attached at the same addresses")


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


def _no_weightless_answer(traffic: Traffic, expected: str, failed_at: float) -> None:
    """Every request was answered, and as the verified engine answers; one of them was
    waiting when the engine failed, and was answered by the engine that replaced it."""
    said = [a.said for a in traffic.answers]
    assert said and all(s == expected for s in said), said
    assert traffic.spanning(failed_at), "no request was held across the failed resume"


def test_a_resume_that_fails_after_the_snapshot_replaces_the_engine_from_that_snapshot(
        held, tmp_path):
    a, holder = held
    before = complete(a)
    # Another holder, empty: the weights the engine maps are gone from under it (a holder
    # restarted while the snapshot is taken), so its resume after the dump cannot map them.
    holder.stop()
    fresh = Holder(tmp_path / "holder", "--no-refill")
    try:
        with Traffic(lambda: complete(a)) as traffic:
            r = a.pitstop("snapshot", "create", "--json")
            failed_at = time.monotonic()
            st = a.wait_recovered(1)
        assert r.returncode == 0, (r.stderr, a.log_tail(3000))
        # The snapshot itself was published: it is told for what it was.
        done = json.loads(r.stdout)
        assert done["kind"] == "hybrid" and "did not resume" in done["engine_failed"], done
        rec = st["last_recovery"]
        assert (rec["cause"], rec["result"]) == ("resume_failed", "success"), rec
        # Back from that very snapshot: the holder refilled, the image restored, the canary
        # it recorded answered.
        assert rec["path"] == "refill" and "verify" in rec["stages"], (rec, a.log_tail(3000))
        assert f"restored snapshot {done['id']} as PID" in a.log()
        assert st["snapshot_error"] == ""
        _no_weightless_answer(traffic, before, failed_at)
        assert a.metric('pitstop_snapshots_created_total{kind="hybrid",result="success"}') == 2
        assert a.metric('pitstop_snapshots_created_total{kind="hybrid",result="failure"}') == 0
        assert a.metric('pitstop_engine_failures_total{cause="resume_failed"}') == 1
    finally:
        fresh.stop()


def test_when_the_snapshot_and_the_resume_both_fail_both_are_told_and_the_engine_replaced(
        held):
    a, holder = held
    before = complete(a)
    holder.stop()  # the weights' holder is gone: the resume after the dump cannot map them
    engine_sock = a.tmp / "state" / "run" / "engine.sock"
    # A connection to the engine from outside, left open: the snapshot is refused.
    outside = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    outside.connect(str(engine_sock))
    try:
        with Traffic(lambda: complete(a)) as traffic:
            r = a.pitstop("snapshot", "create")
            failed_at = time.monotonic()
            outside.close()
            st = a.wait_recovered(1)
    finally:
        outside.close()
    assert r.returncode != 0
    assert "did not resume after the snapshot: " in r.stderr, r.stderr
    assert "and the snapshot itself failed: " in r.stderr and "connection" in r.stderr, r.stderr
    rec = st["last_recovery"]
    assert (rec["cause"], rec["path"], rec["result"]) == ("resume_failed", "cold", "success"), \
        (rec, a.log_tail(3000))
    assert "hybrid skipped: holder at" in " | ".join(fallthroughs(rec))
    _no_weightless_answer(traffic, before, failed_at)
    # Counted under the kind it was to be, not as a full one.
    assert a.metric('pitstop_snapshots_created_total{kind="hybrid",result="failure"}') == 1
    assert a.metric('pitstop_snapshots_created_total{kind="full",result="failure"}') == 0
