"""The holder's refill against a real `pitstop holder` process: it loads a model's weights
itself, from a plan, into exactly the regions a tenant makes, and commits all or nothing."""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.errors import HolderRefusedError
from agent.holder import protocol as p
from agent.holder.weightplan import (
    DriftCode,
    RefillPlan,
    WeightFile,
    build_plan,
    load_plan,
    region_name,
    weight_regions,
    write_plan,
)
from agent.modelgen import make_model, spec_for
from agent.weights import WeightsDigester
from tests.holder_proc import Holder, wait_for

pytestmark = pytest.mark.integration


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A real safetensors file of uint8 tensors (an 8-byte header length, JSON, the data)."""
    header, at = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [at, at + len(data)]}
        at += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """Two shards of random bytes (one of them bigger than one read piece) and a config."""
    d = tmp_path / "model"
    d.mkdir()
    write_safetensors(d / "model-00001-of-00002.safetensors",
                      {"a": os.urandom(3 << 20), "b": os.urandom(123_457)})
    write_safetensors(d / "model-00002-of-00002.safetensors", {"c": os.urandom(17 << 20)})
    (d / "config.json").write_text('{"model_type": "test"}')
    return d


def plan_for(model: Path, holder_dir: Path) -> RefillPlan:
    d = WeightsDigester(None).digest(model)
    plan = build_plan(model, d.files, d.digest)
    write_plan(holder_dir, plan)
    return plan


def region_bytes(holder: Holder, name: str) -> bytes:
    with holder.client() as c, c.attach(name) as g:
        [fd] = g.fds
        with mmap.mmap(fd, g.region.mapped_size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            return m[:g.region.size]


def file_data(path: Path) -> bytes:
    f = WeightFile.read_header(path)
    return path.read_bytes()[f.data_offset:]


def test_a_refill_commits_every_region_with_the_bytes_of_its_file(holder, model):
    plan = plan_for(model, holder.sock.parent)
    with holder.client() as c:
        done = c.refill(plan.digest)
        assert (done.regions, done.bytes) == (2, plan.bytes)
        regions = c.committed_set(plan.digest)
    assert regions is not None and [r.name for r in regions] == [r.name for r in plan.regions]
    for path in sorted(model.glob("*.safetensors")):
        same = region_bytes(holder, region_name(plan.digest, path)) == file_data(path)
        assert same, f"{path.name}: the held bytes are not the file's"
    assert "refill of" in holder.log.read_text() and "committed" in holder.log.read_text()


def test_a_refill_makes_the_regions_a_tenant_makes_byte_for_byte(tmp_path, model):
    """The tenant (HeldWeights, loading from disk) and the holder's refill, each into its own
    holder: the same names, sizes, chunks and bytes, so an engine restored over the one
    re-attaches the other."""
    torch = pytest.importorskip("torch")
    from agent.tenant.weights import HeldWeights

    digest = WeightsDigester(None).digest(model).digest
    by_tenant, by_refill = Holder(tmp_path / "h1"), Holder(tmp_path / "h2")
    try:
        files = sorted(model.glob("*.safetensors"))
        hw = HeldWeights.open(by_tenant.sock, files, digest, torch.device("cpu"))
        assert hw.source == "disk"
        hw.held.close()
        plan_for(model, by_refill.sock.parent)
        with by_refill.client() as c:
            c.refill(digest)
        with by_tenant.client() as a, by_refill.client() as b:
            made = [(r.name, r.size, r.chunks, r.parts) for r in a.committed_set(digest)]
            refilled = [(r.name, r.size, r.chunks, r.parts) for r in b.committed_set(digest)]
        assert made == refilled
        for name, *_ in made:
            same = region_bytes(by_tenant, name) == region_bytes(by_refill, name)
            assert same, f"{name}: the tenant's and the refill's bytes differ"
    finally:
        by_tenant.stop()
        by_refill.stop()


def test_a_weights_file_changed_on_disk_is_drift_and_the_refill_is_refused(holder, model):
    plan = plan_for(model, holder.sock.parent)
    shard = model / "model-00002-of-00002.safetensors"
    with shard.open("r+b") as f:  # same size, other bytes: only the stat key tells
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xfe\xfd\xfc")
    drift = load_plan(holder.sock.parent).drift()
    assert drift is not None and drift.code is DriftCode.CHANGED and drift.where == shard.name
    with holder.client() as c, pytest.raises(HolderRefusedError) as e:
        c.refill(plan.digest)
    assert e.value.code == p.ErrorCode.DRIFT.value
    assert shard.name in str(e.value)
    assert holder.stats().bytes_held == 0


def test_a_file_added_to_the_model_directory_is_drift(holder, model):
    plan_for(model, holder.sock.parent)
    (model / "extra.safetensors").write_bytes((model / "model-00002-of-00002.safetensors")
                                              .read_bytes())
    drift = load_plan(holder.sock.parent).drift()
    assert drift is not None and drift.code is DriftCode.FILES
    assert "added extra.safetensors" in str(drift)


def test_without_a_plan_or_with_one_of_other_weights_the_refill_is_refused(holder, model):
    with holder.client() as c, pytest.raises(HolderRefusedError) as e:
        c.refill("sha256:" + "0" * 64)
    assert e.value.code == p.ErrorCode.NO_PLAN.value and "no refill plan" in str(e.value)
    plan_for(model, holder.sock.parent)
    with holder.client() as c, pytest.raises(HolderRefusedError) as e:
        c.refill("sha256:" + "0" * 64)
    assert e.value.code == p.ErrorCode.NO_PLAN.value and "is for weights" in str(e.value)


def test_a_plan_others_can_write_is_not_trusted(holder, model):
    plan_for(model, holder.sock.parent)
    os.chmod(holder.sock.parent / "refill.json", 0o666)
    with holder.client() as c, pytest.raises(HolderRefusedError) as e:
        c.refill(plan_for.__name__)  # any digest: the plan is refused before it is read
    assert e.value.code == p.ErrorCode.NO_PLAN.value and "not writable by others" in str(e.value)


def test_regions_being_refilled_cannot_be_attached_and_a_holder_killed_mid_load_leaves_none(
        tmp_path, model):
    base = tmp_path / "holder"
    slow = Holder(base, "--refill-rate", "2")  # 2 MB/s: 21 MB take about ten seconds
    plan = plan_for(model, slow.sock.parent)
    answer: list[object] = []

    def ask() -> None:
        try:
            with slow.client() as c:
                answer.append(c.refill(plan.digest))
        except Exception as e:  # noqa: BLE001 - the test reads what came back
            answer.append(e)

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(lambda: slow.stats().regions_pending == 2, "the refill's regions")
    with slow.client() as c:
        assert not c.has_committed(plan.digest)
        with pytest.raises(HolderRefusedError) as e:
            c.attach(plan.regions[0].name)
        assert e.value.code == p.ErrorCode.NOT_COMMITTED.value
    os.kill(slow.proc.pid, signal.SIGKILL)
    slow.proc.wait()
    asker.join(10)
    assert answer and isinstance(answer[0], Exception)
    again = Holder(base, "--no-refill")
    try:
        st = again.stats()
        assert (st.regions_committed, st.regions_pending, st.bytes_held) == (0, 0, 0)
        with again.client() as c:
            assert c.committed_set(plan.digest) is None
    finally:
        again.stop()


def test_a_second_refill_request_joins_the_running_one(tmp_path, model):
    slow = Holder(tmp_path / "holder", "--refill-rate", "20")
    try:
        plan = plan_for(model, slow.sock.parent)
        got: list[p.Refilled] = []
        threads = [threading.Thread(target=lambda: got.append(slow.client().refill(plan.digest)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(got) == 2 and got[0] == got[1] and got[0].bytes == plan.bytes
        assert slow.log.read_text().count("refill of") == 2  # one started, one committed
    finally:
        slow.stop()


def test_a_drop_mid_refill_cancels_it_and_commits_nothing(tmp_path, model):
    slow = Holder(tmp_path / "holder", "--refill-rate", "2")
    try:
        plan = plan_for(model, slow.sock.parent)
        answer: list[object] = []

        def ask() -> None:
            try:
                with slow.client() as c:
                    answer.append(c.refill(plan.digest))
            except HolderRefusedError as e:
                answer.append(e)

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: slow.stats().regions_pending == 2, "the refill's regions")
        with slow.client() as c:
            c.drop(p.DropReason.GPU_FAULT, "test")
        asker.join(10)
        [err] = answer
        assert isinstance(err, HolderRefusedError) and err.code == "refill_failed"
        assert "nothing was committed" in str(err)
        st = slow.stats()
        assert (st.regions_committed, st.regions_pending) == (0, 0)
    finally:
        assert slow.stop() == 0


def test_a_holder_started_beside_a_plan_refills_by_itself(tmp_path, model):
    base = tmp_path / "holder"
    (base / "cpu").mkdir(parents=True, mode=0o700)
    plan = plan_for(model, base / "cpu")
    h = Holder(base)
    try:
        with h.client() as c:
            wait_for(lambda: c.has_committed(plan.digest), "the start-up refill", timeout=30)
        assert h.stats().bytes_committed >= plan.bytes
    finally:
        h.stop()


def _ready_holder(tmp_path: Path, model: Path) -> tuple[Holder, RefillPlan]:
    """A holder started with a plan beside it and --no-refill, once its sink is made."""
    base = tmp_path / "holder"
    (base / "cpu").mkdir(parents=True, mode=0o700)
    plan = plan_for(model, base / "cpu")
    h = Holder(base, "--no-refill")
    wait_for(lambda: f"ready to refill {plan.digest}" in h.log.read_text(), "the sink")
    return h, plan


def test_a_holder_that_does_not_refill_at_start_has_the_refill_ready_for_when_it_is_asked(
        tmp_path, model):
    # On cuda, the context, streams and pinned buffers take about a third of a 32 GiB load.
    h, plan = _ready_holder(tmp_path, model)
    try:
        assert h.stats().bytes_committed == 0
        assert h.client().refill(plan.digest).bytes == plan.bytes
        assert f"refill of {plan.digest} started: " in h.log.read_text()
        assert "(its sink made ahead)" in h.log.read_text()
    finally:
        h.stop()


def test_weights_an_engine_committed_itself_leave_nothing_ready_to_refill(tmp_path, model):
    h, plan = _ready_holder(tmp_path, model)
    try:
        with h.client() as c:  # the engine's first start: it loads the regions itself
            for r in plan.regions:
                c.create(r.name, r.size, plan.digest, parts=len(plan.regions)).close()
            for r in plan.regions:
                c.commit(r.name)
        wait_for(lambda: f"no longer ready to refill {plan.digest}" in h.log.read_text(),
                 "the sink given back")
    finally:
        h.stop()


def test_other_weights_an_engine_committed_leave_nothing_ready_to_refill(tmp_path, model):
    # The node's engine now runs another model: no refill of the planned one is coming.
    h, plan = _ready_holder(tmp_path, model)
    other = "sha256:" + "cd" * 32
    try:
        with h.client() as c:
            c.create(f"{other}/model.safetensors", 4096, other, parts=1).close()
            c.commit(f"{other}/model.safetensors")
        wait_for(lambda: f"no longer ready to refill {plan.digest}: an engine committed other "
                 f"weights ({other})" in h.log.read_text(), "the sink given back")
    finally:
        h.stop()


def test_a_refill_refused_for_drift_leaves_nothing_ready_to_refill(tmp_path, model):
    h, plan = _ready_holder(tmp_path, model)
    try:
        weights = next(model.glob("*.safetensors"))
        os.utime(weights, ns=(1, 1))  # the plan's stat key no longer holds
        with pytest.raises(HolderRefusedError) as refused:
            h.client().refill(plan.digest)
        assert refused.value.code == p.ErrorCode.DRIFT
        assert f"no longer ready to refill {plan.digest}: refill of {plan.digest} refused" \
            in h.log.read_text()
    finally:
        h.stop()


def test_the_plan_names_the_regions_the_tenant_layout_makes(model):
    digest = WeightsDigester(None).digest(model).digest
    files = [WeightFile.read_header(f) for f in sorted(model.glob("*.safetensors"))]
    d = WeightsDigester(None).digest(model)
    plan = build_plan(model, d.files, d.digest)
    assert [(r.name, r.offset, r.size) for r in plan.regions] == [
        (r.name, r.offset, r.size) for r in weight_regions(digest, files)]
    assert {f.name for f in plan.files} == {"config.json", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors"}


@pytest.mark.parametrize(("buffers", "host"), [(1, "pinned"), (2, "wc"), (3, "pinned"),
                                              (2, "huge"), (2, "direct")])
def test_the_cuda_loader_puts_every_byte_in_place_through_its_buffers(tmp_path, model, buffers,
                                                                      host):
    """The cuda side on a driver fake whose copies run only when their stream is
    synchronized: a pinned buffer refilled (or a file range unregistered) before its last
    copy ended would land wrong bytes. Small chunks and pieces make pieces cross chunks and
    buffers turn over; huge pins its own buffers with cuMemHostRegister, direct registers
    every piece's pages, never one page twice."""
    from agent.holder.backends import Allocation
    from agent.holder.backends.cuda import plan_chunks
    from agent.holder.refill import Host, Tuning
    from agent.holder.refill.cuda import WRITECOMBINED, CudaSink
    from agent.holder.refill.job import RefillJob
    from tests.fake_cuda import FakeCuda

    d = WeightsDigester(None).digest(model)
    plan = build_plan(model, d.files, d.digest)
    cu = FakeCuda()
    granularity = 2 << 20
    allocations = []
    for r in plan.regions:
        chunks = plan_chunks(r.size, granularity, max_chunk=granularity)
        allocations.append(Allocation(fds=[], chunks=chunks,
                                      handle=[bytearray(n) for n in chunks]))
    tuning = Tuning(threads=3, piece=1 << 20, buffers=buffers, host=Host(host))
    sink = CudaSink(SimpleNamespace(ordinal=0, align=granularity), tuning, driver=cu)
    ended = threading.Event()
    job = RefillJob(plan, allocations, sink, on_done=ended.set, tuning=tuning)
    job.start()
    assert ended.wait(60)
    assert job.error is None, job.error
    for r, a in zip(plan.regions, allocations, strict=True):
        same = b"".join(a.handle)[:r.size] == file_data(model / r.file)  # no 20 MB diff
        assert same, f"{r.name}: the held bytes are not the file's"
    # Everything the load made is gone again: the context, the pinned buffers, the VA.
    assert +cu.live == Counter(), cu.live
    # threads x buffers host buffers, each made as `host` says; every registration undone.
    if host == "direct":  # no buffers; every piece registered (21 MB in 1 MiB pieces)
        assert cu.host_flags == [] and cu.registrations >= 20, cu.registrations
    elif host == "huge":
        assert cu.host_flags == [] and cu.registrations == 3 * buffers
    else:
        flags = WRITECOMBINED if host == "wc" else 0
        assert cu.host_flags == [flags] * 3 * buffers and cu.registrations == 0


def test_a_cuda_loader_that_cannot_pin_its_buffers_fails_the_load_and_frees_all(model):
    """Pinned memory running out while the sink prepares (on its own thread) is the job's
    error, not a hang or a half load, and what was made before is given back."""
    from agent.holder.backends import Allocation
    from agent.holder.refill import Tuning
    from agent.holder.refill.cuda import CudaSink
    from agent.holder.refill.job import RefillJob
    from tests.fake_cuda import FakeCuda

    d = WeightsDigester(None).digest(model)
    plan = build_plan(model, d.files, d.digest)
    cu = FakeCuda()
    cu.host_alloc_fails_after = 3
    allocations = [Allocation(fds=[], chunks=[r.size], handle=[bytearray(r.size)])
                   for r in plan.regions]
    tuning = Tuning(threads=2, piece=1 << 20, buffers=2)
    sink = CudaSink(SimpleNamespace(ordinal=0, align=1), tuning, driver=cu)
    ended = threading.Event()
    job = RefillJob(plan, allocations, sink, on_done=ended.set, tuning=tuning)
    job.start()
    assert ended.wait(60)
    assert job.error is not None and "CUDA_ERROR_OUT_OF_MEMORY" in str(job.error)
    assert all(not any(a.handle[0]) for a in allocations)  # nothing was copied
    assert +cu.live == Counter(), cu.live


def test_a_cuda_sink_closed_before_it_was_opened_frees_what_it_prepared():
    """The server makes the sink first; when creating the regions then fails, the sink is
    closed unopened and the context and pinned buffers it made go back."""
    from agent.holder.refill import Tuning
    from agent.holder.refill.cuda import CudaSink
    from tests.fake_cuda import FakeCuda

    cu = FakeCuda()
    sink = CudaSink(SimpleNamespace(ordinal=0, align=1), Tuning(threads=4, piece=4096),
                    driver=cu)
    sink.close()
    assert len(cu.host_flags) == 8 and +cu.live == Counter(), cu.live


def test_a_cuda_sink_closed_on_another_thread_gives_that_thread_its_context_back():
    """The server's loop discards a sink made ahead: the loop thread's own current context
    (the backend's, for drivers that want one for cuMemCreate) is what it has after, not the
    sink's, released."""
    from agent.holder.refill import Tuning
    from agent.holder.refill.cuda import CudaSink
    from tests.fake_cuda import FakeCuda

    cu = FakeCuda()
    cu.cuCtxSetCurrent(4242)  # the backend's context, current on this (the loop's) thread
    sink = CudaSink(SimpleNamespace(ordinal=0, align=1), Tuning(threads=1, piece=4096),
                    driver=cu)
    sink.close()
    assert cu.cuCtxGetCurrent() == (0, 4242)
    assert +cu.live == Counter(), cu.live


@pytest.mark.parametrize("quant", ["fp8", "fp8-ct"])
def test_an_fp8_checkpoint_is_planned_section_by_section_like_any_other(tmp_path, quant):
    # Its linear weights are F8_E4M3: a plan of the files (and, where vLLM holds them in
    # another layout, a copy of the held set) must still be made of it.
    d = tmp_path / "model"
    make_model(d, spec_for("tiny", quant=quant))
    files = [WeightFile.read_header(f) for f in sorted(d.glob("*.safetensors"))]
    assert "F8_E4M3" in {e.dtype for f in files for e in f.tensors.values()}
    digest = WeightsDigester(None).digest(d)
    plan = build_plan(d, digest.files, digest.digest)
    assert [(r.name, r.size) for r in plan.regions] == [
        (r.name, r.size) for r in weight_regions(digest.digest, files)]
    assert plan.bytes == sum(f.data_size for f in files)
