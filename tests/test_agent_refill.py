"""The refill rung through the real agent: a holder that lost the weights loads them again
from the model files, then the hybrid image is restored over them (real CRIU, a real
`pitstop holder --backend cpu`, the reference engine on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.agentproc import RunningAgent, complete, fallthroughs, held_agent, snapshot_list
from tests.holder_proc import Holder, wait_for
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required

pytestmark = pytest.mark.integration


@pytest.fixture
def model(tmp_path, tiny_model) -> Path:
    """A private copy of the tiny model: some tests rewrite its weights file."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    return d


@pytest.fixture
def held(tmp_path, model):
    """A cpu holder, an agent whose engine keeps its weights there, its hybrid snapshot
    published and the refill plan it leaves beside the holder's socket written."""
    with held_agent(tmp_path, model) as (a, holder):
        wait_for(lambda: plan_path(tmp_path).exists(), "the refill plan", timeout=30)
        yield a, holder


def plan_path(tmp_path: Path) -> Path:
    return tmp_path / "holder" / "cpu" / "refill.json"


def falls(rec: dict) -> str:
    return " | ".join(fallthroughs(rec))


def code(rec: dict, path: str) -> str:
    """The refusal code of `path`'s fall-through in a recovery (pitstop status JSON)."""
    [found] = [f["refusal"]["code"] for f in rec["fallthroughs"] if f["path"] == path]
    return found


def metric(a: RunningAgent, name: str) -> float:
    with urllib.request.urlopen(a.metrics_url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in the agent's metrics")


def test_a_holder_restarted_empty_is_refilled_and_the_hybrid_image_answers_the_canary(
        held, tmp_path):
    a, holder = held
    before = complete(a)
    digest = json.loads(plan_path(tmp_path).read_text())["digest"]
    holder.stop()
    empty = Holder(tmp_path / "holder", "--no-refill")  # another holder id, nothing held
    try:
        assert empty.stats().bytes_held == 0
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(1)["last_recovery"]
        assert rec["path"] == "refill", (rec, a.log_tail(3000))
        assert "hybrid skipped" in falls(rec) and "is gone" in falls(rec)
        assert {"refill", "criu_restore", "resume"} <= set(rec["stages"])
        with empty.client() as c:
            regions = c.committed_set(digest)
        assert regions is not None and all(r.holder_id == empty.stats().holder_id
                                           for r in regions)
        assert complete(a) == before
        a.logged("held weights re-attached at the same addresses")
        assert metric(a, "pitstop_holder_refill_bytes_total") >= sum(r.size for r in regions)
        [snap] = snapshot_list(a)
        assert snap["kind"] == "hybrid"  # the same image, restored over refilled weights
        # The next crash finds the refilled weights held: hybrid again, by digest.
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(2)["last_recovery"]
        assert rec["path"] == "hybrid", rec
        assert complete(a) == before
    finally:
        empty.stop()


def test_a_refill_cut_by_the_holder_dying_leaves_nothing_attachable_and_the_ladder_falls_on(
        held, tmp_path):
    a, holder = held
    digest = json.loads(plan_path(tmp_path).read_text())["digest"]
    holder.stop()
    # 0.2 MB/s: the 2.5 MB of weights would take over ten seconds to load.
    slow = Holder(tmp_path / "holder", "--no-refill", "--refill-rate", "0.2")
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    wait_for(lambda: slow.stats().regions_pending > 0, "the agent's refill to start", 60)
    os.kill(slow.proc.pid, signal.SIGKILL)
    slow.proc.wait()
    rec = a.wait_recovered(1)["last_recovery"]
    said = falls(rec)
    assert "refill start failed: refill of" in said, rec
    assert code(rec, "refill") == "refill_failed"
    # The rung after refill was tried next, with its own reason (this node has no full image).
    assert said.index("refill start failed") < said.index("full skipped")
    assert rec["path"] == "cold"
    again = Holder(tmp_path / "holder", "--no-refill")
    try:
        with again.client() as c:
            assert c.committed_set(digest) is None and c.list() == []
    finally:
        again.stop()
    # The image was not at fault: it is kept, not quarantined (the full one is the cold
    # engine's, taken without a holder).
    assert "hybrid" in [s["kind"] for s in snapshot_list(a)]
    assert "quarantined" not in a.log()


def add_metadata(path: Path) -> None:
    """Rewrite a safetensors file with a `__metadata__` entry: the same tensors (so the same
    answers) in a file of other bytes, so other weights by digest."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"rewritten": "by the test"}
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_a_weights_file_changed_on_disk_is_drift_and_the_refill_is_refused(held, tmp_path,
                                                                           model):
    a, holder = held
    old = json.loads(plan_path(tmp_path).read_text())["digest"]
    holder.stop()
    empty = Holder(tmp_path / "holder", "--no-refill")
    try:
        add_metadata(model / "model.safetensors")
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(1)["last_recovery"]
        said = falls(rec)
        assert "refill skipped: the weights on disk" in said, rec
        assert code(rec, "refill") == "weights_changed"
        assert "model.safetensors: changed since the plan was made (size" in said
        assert "hybrid skipped" in said and rec["path"] == "cold"
        # The new engine loaded the new file into the holder; the plan follows it.
        assert empty.stats().bytes_committed > 0
        wait_for(lambda: json.loads(plan_path(tmp_path).read_text())["digest"] != old,
                 "the plan of the new weights", 30)
    finally:
        empty.stop()


def test_a_holder_that_starts_beside_its_plan_refills_by_itself_before_the_engine_needs_it(
        held, tmp_path):
    a, holder = held
    before = complete(a)
    digest = json.loads(plan_path(tmp_path).read_text())["digest"]
    holder.stop()
    rebooted = Holder(tmp_path / "holder")  # as after a reboot: the plan is all it has
    try:
        with rebooted.client() as c:
            wait_for(lambda: c.has_committed(digest), "the start-up refill", 60)
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        rec = a.wait_recovered(1)["last_recovery"]
        assert rec["path"] == "hybrid", rec
        assert "refill" not in rec["stages"]
        assert complete(a) == before
    finally:
        rebooted.stop()


def test_after_a_gpu_fault_the_refill_rung_stays_on_the_ladder_and_hybrid_does_not():
    """The refill loads the weights into new memory: nothing a GPU fault made suspect is
    reused (the holder dropped it, or, when it could not, still holds it, and then the
    refill is skipped as 'held already')."""
    from agent.gpu_health import FaultKind, GpuCheck, GpuFault, Verdict
    from agent.supervisor.gpu import ruled_out
    from agent.supervisor.paths.holder import HybridRestore
    from agent.supervisor.paths.refill import RefillRestore

    fault = GpuCheck(faults=(GpuFault(FaultKind.XID_MEMORY, "Xid 48", xid=48),))
    assert fault.verdict is Verdict.MEMORY_SUSPECT
    assert ruled_out(RefillRestore, fault) is None
    assert ruled_out(HybridRestore, fault) is not None


def test_after_the_holder_dropped_everything_the_refill_loads_the_weights_again(held, tmp_path):
    """What a GPU fault leaves: the same holder, told to drop all it held."""
    from agent.holder import protocol as p

    a, holder = held
    before = complete(a)
    with holder.client() as c:
        assert c.drop(p.DropReason.GPU_FAULT, "the test's fault").regions > 0
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    rec = a.wait_recovered(1)["last_recovery"]
    assert rec["path"] == "refill", rec
    assert complete(a) == before
    assert holder.stats().regions_committed > 0


def test_weights_held_in_another_layout_than_the_files_get_a_plan_of_their_copy(holder, model):
    """vLLM holds its parameters in its own layout under the weights digest: a refill of
    the files would not give those regions, so the plan loads a copy of them instead, made
    once (the plan of the files goes), and a holder restarted empty refills from it."""
    import torch

    from agent.config import HolderConfig
    from agent.holder.plans import RefillPlans
    from agent.holder.weightplan import PLAN_NAME, PlanSource, load_plan, plan_for, write_plan
    from agent.supervisor.paths.holder import HolderLink, HybridRestore
    from agent.supervisor.paths.refill import RefillRestore
    from agent.tenant.mapping import HeldSet, HostSpace
    from agent.weights import WeightsDigester

    digest = WeightsDigester(None).digest(model).digest
    link = HolderLink(HolderConfig(enabled=True, dir=holder.base, gpu="cpu"), holder.base,
                      gpu=lambda: "cpu", digest=lambda: digest,
                      adapter=SimpleNamespace(holder_refusal=lambda: None))
    plans = RefillPlans(model, digester=WeightsDigester(None))
    hybrid = HybridRestore(link, snapshotter=None, unavailable="no snapshots here", adapter=None,
                           socket=holder.base / "engine.sock", identity=lambda: None,
                           metrics=None, timeout_s=1.0)
    rung = RefillRestore(hybrid, link, plans)
    plan_file = holder.sock.parent / PLAN_NAME
    assert rung.remember(digest) is None and not plan_file.exists()  # nothing held yet
    write_plan(holder.sock.parent, plan_for(model, WeightsDigester(None), digest))
    name = f"{digest}/vllm-params-abc"
    data = os.urandom(1 << 20)
    with holder.client() as c:
        held = HeldSet.create(c, digest, {name: len(data)}, HostSpace)
        held.tensor(name)[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        held.commit()
        held.close()
    # A backend whose regions cannot be read back (none of cpu and cuda): no copy, no plan.
    with holder.client() as c:
        regions = c.committed_set(digest)
    assert plans._remember_copy(holder.sock, digest, regions, "rocm") is None
    assert not plan_file.exists()
    assert rung.remember(digest) == plan_file
    plan = load_plan(holder.sock.parent)
    assert plan is not None and plan.source is PlanSource.COPY
    assert [r.name for r in plan.regions] == [name] and plan.drift() is None
    # Once made, it is kept: the agent remembers at every recovery, the copy is made once.
    stamp = plan_file.stat().st_mtime_ns
    assert rung.remember(digest) is None and plan_file.stat().st_mtime_ns == stamp
    holder.stop()
    empty = Holder(holder.base, "--no-refill")
    try:
        assert empty.client().refill(digest).bytes == len(data)
        with empty.client() as c:
            again = HeldSet.attach(c, digest, HostSpace)
        assert bytes(again.tensor(name).numpy()) == data
        again.close()
    finally:
        empty.stop()
