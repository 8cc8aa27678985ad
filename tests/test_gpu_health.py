"""The GPU watch and the fault rule, driven by NVML events injected at the module boundary."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agent.gpu_health import FaultKind, GpuWatch, PeakSampler, Verdict
from agent.metrics import Metrics, new_registry
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.gpu import GpuGuard, ruled_out
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.paths.holder import HybridRestore, WarmStart
from agent.supervisor.paths.restore import FullRestore
from agent.supervisor.paths.vllm import VllmPreloadStart, VllmSnapshotRestore
from tests.fake_nvml import FakeGpu, FakeNvml


def wait_until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def nvml():
    return FakeNvml()


@pytest.fixture
def watch(nvml):
    w = GpuWatch(0, nvml=nvml, wait_ms=20)
    w.start()
    yield w
    w.close()


def settle(watch: GpuWatch, nvml: FakeNvml) -> None:
    """Wait until the watch's thread has taken every injected event."""
    wait_until(lambda: nvml.gpu.events.empty(), "the watch to take its events")
    time.sleep(0.05)


def test_a_healthy_gpu_reports_no_fault_and_single_bit_errors_are_not_watched(watch, nvml):
    assert nvml.gpu.registered == [nvml.nvmlEventTypeXidCriticalError
                                   | nvml.nvmlEventTypeDoubleBitEccError]
    time.sleep(0.1)  # a few event waits time out
    check = watch.check()
    assert check.verdict is Verdict.HEALTHY and check.faults == ()
    assert check.describe() == "healthy"


def test_a_memory_xid_makes_held_memory_suspect(watch, nvml):
    nvml.xid(48)
    settle(watch, nvml)
    check = watch.check()
    assert check.verdict is Verdict.MEMORY_SUSPECT
    [fault] = check.faults
    assert (fault.kind, fault.xid) == (FaultKind.XID_MEMORY, 48)
    assert check.describe() == "Xid 48 (double-bit ECC error)"


def test_an_xid_raised_by_a_program_is_not_a_fault_of_the_gpu(watch, nvml):
    for xid in (13, 31, 43, 45):
        nvml.xid(xid)
    settle(watch, nvml)
    assert watch.check().verdict is Verdict.HEALTHY


def test_a_double_bit_ecc_event_counts_once_even_though_the_count_rose_too(watch, nvml):
    nvml.double_bit_ecc()
    settle(watch, nvml)
    check = watch.check()
    assert check.verdict is Verdict.MEMORY_SUSPECT
    assert {f.kind for f in check.faults} == {FaultKind.ECC_UNCORRECTED}
    watch.acknowledge(check)
    assert watch.check().verdict is Verdict.HEALTHY


def test_an_ecc_error_without_an_event_is_found_by_the_health_read(watch, nvml):
    nvml.gpu.ecc_uncorrected = 2
    check = watch.check()
    assert check.verdict is Verdict.MEMORY_SUSPECT
    assert "volatile uncorrected ECC errors rose from 0 to 2" in check.describe()
    watch.acknowledge(check)
    assert watch.check().verdict is Verdict.HEALTHY


@pytest.mark.parametrize("xid", [79, 95, 119, 120])
def test_a_fatal_xid_makes_the_gpu_unusable(watch, nvml, xid):
    nvml.xid(xid)
    settle(watch, nvml)
    check = watch.check()
    assert check.verdict is Verdict.UNUSABLE
    assert check.faults[0].kind is FaultKind.XID_FATAL


def test_a_changed_recovery_action_is_judged_by_what_the_driver_asks_for(watch, nvml):
    nvml.xid(154)
    settle(watch, nvml)
    assert watch.check().verdict is Verdict.HEALTHY  # the action is still "none"
    nvml.gpu.recovery_action = 3  # drain peer-to-peer traffic: no matter to one GPU
    assert watch.check().verdict is Verdict.HEALTHY
    nvml.gpu.recovery_action = 4
    check = watch.check()
    assert check.verdict is Verdict.UNUSABLE
    assert check.describe() == "the driver asks for draining, then a GPU reset"


def test_a_gpu_that_fell_off_the_bus_is_unusable_and_the_watch_ends_cleanly(watch, nvml):
    nvml.fall_off_the_bus()
    wait_until(lambda: nvml.freed_sets == 1, "the watch to free its event set")
    check = watch.check()
    assert check.verdict is Verdict.UNUSABLE
    assert {f.kind for f in check.faults} == {FaultKind.GPU_LOST}
    assert "the GPU is lost" in check.describe()
    assert nvml.gpu.inits == 0  # the thread shut its NVML session down as it left


@pytest.mark.parametrize(("change", "said"), [
    ({"remap_pending": True}, "a row remapping is pending: the GPU needs a reset"),
    ({"remap_failure": True}, "a row remapping failed"),
    ({"recovery_action": 1}, "the driver asks for a GPU reset"),
    ({"recovery_action": 2}, "the driver asks for a node reboot"),
])
def test_a_gpu_that_needs_a_reset_is_unusable(watch, nvml, change, said):
    for k, v in change.items():
        setattr(nvml.gpu, k, v)
    check = watch.check()
    assert check.verdict is Verdict.UNUSABLE
    assert check.faults[0].kind is FaultKind.RESET_REQUIRED
    assert said in check.describe()


def test_acknowledging_a_check_keeps_the_faults_that_came_after_it(watch, nvml):
    nvml.xid(48)
    settle(watch, nvml)
    first = watch.check()
    nvml.xid(94)
    settle(watch, nvml)
    watch.acknowledge(first)
    assert watch.check().describe() == "Xid 94 (contained ECC error)"


def test_a_gpu_without_fault_events_is_still_read_at_a_failure():
    nvml = FakeNvml(FakeGpu(supported_events=0, ecc_uncorrected=None, recovery_action=None))
    w = GpuWatch(nvml.gpu.uuid, nvml=nvml)
    w.start()
    try:
        assert w.registered == 0 and nvml.gpu.registered == []
        assert w.check().verdict is Verdict.HEALTHY  # no ECC, no recovery field: no finding
        nvml.gpu.remap_pending = True
        assert w.check().verdict is Verdict.UNUSABLE
    finally:
        w.close()
    assert nvml.gpu.inits == 0


def test_a_gpu_lost_before_the_watch_began_is_watched_as_lost():
    nvml = FakeNvml(FakeGpu(lost=True))
    w = GpuWatch(0, nvml=nvml)
    w.start()
    check = w.check()
    assert check.verdict is Verdict.UNUSABLE and check.faults[0].kind is FaultKind.GPU_LOST
    assert PeakSampler(w.memory_used, every_s=0.001).start().stop() is None
    w.close()
    assert nvml.gpu.inits == 0


def test_a_gpu_that_is_not_there_is_named():
    from agent.errors import IdentityError

    with pytest.raises(IdentityError, match="cannot watch GPU 'GPU-nope'.*nvidia-smi -L"):
        GpuWatch("GPU-nope", nvml=FakeNvml()).start()


def test_the_peak_sampler_keeps_the_most_memory_seen():
    seen = iter([3, 9, 4, 7])
    done = threading.Event()

    def read() -> int:
        try:
            return next(seen)
        except StopIteration:
            done.set()
            raise RuntimeError("the GPU went away") from None

    sampler = PeakSampler(read, every_s=0.001).start()
    assert done.wait(5)
    assert sampler.stop() == 9


def test_a_sampler_that_read_nothing_has_no_peak():
    def read() -> int:
        raise RuntimeError("NVML: GPU is lost")

    assert PeakSampler(read, every_s=0.001).start().stop() is None


# --- the rule the ladder follows ------------------------------------------------------------
def test_exactly_the_rungs_that_reuse_held_memory_are_ruled_out_after_a_fault(watch, nvml):
    reusing = {c.name for c in (HybridRestore, WarmStart, VllmPreloadStart)}
    fresh = {c.name for c in (FullRestore, ColdStart, VllmSnapshotRestore)}
    assert all(c.reuses_held_memory for c in (HybridRestore, WarmStart, VllmPreloadStart))
    assert not any(c.reuses_held_memory for c in (FullRestore, ColdStart, VllmSnapshotRestore))
    rungs = [HybridRestore, FullRestore, WarmStart, VllmSnapshotRestore, VllmPreloadStart,
             ColdStart]
    assert {r.name for r in rungs if ruled_out(r, watch.check()) is not None} == set()
    nvml.xid(63)
    settle(watch, nvml)
    check = watch.check()
    out = {r.name: ruled_out(r, check) for r in rungs}
    assert {n for n, why in out.items() if why is not None} == reusing
    assert {n for n, why in out.items() if why is None} == fresh
    assert out["hybrid"] == Refusal(
        RefusalCode.GPU_FAULT, "GPU fault (Xid 63 (ECC page retirement or row remapping)): the "
        "memory it would reuse may be corrupt")


def test_the_guard_counts_each_fault_once_and_distrusts_a_holder_that_did_not_drop(nvml):
    metrics = Metrics(new_registry(), lambda: None)
    metrics.gpu_watched()

    def refuse(detail: str) -> str:
        raise OSError("holder socket gone mid-call")

    w = GpuWatch(0, nvml=nvml, wait_ms=20)
    w.start()
    guard = GpuGuard(w, drop_held=refuse, metrics=metrics)

    def count(kind: str) -> float:
        return metrics.registry.get_sample_value("pitstop_gpu_faults_total", {"kind": kind})

    async def scenario() -> None:
        assert (await guard.check()).verdict is Verdict.HEALTHY
        nvml.xid(48)
        nvml.gpu.ecc_uncorrected = 1
        settle(w, nvml)
        check = await guard.check()
        await guard.check()  # asked again at the start of the walk: counted once
        assert check.verdict is Verdict.MEMORY_SUSPECT
        said = await guard.drop_held(check)
        assert said.startswith("the holder could not be told to drop its memory")
        assert guard.held_suspect
        guard.acknowledge()
        assert not guard.held_suspect
        assert (await guard.check()).verdict is Verdict.HEALTHY

    try:
        asyncio.run(scenario())
    finally:
        w.close()
    assert count("xid_memory") == 1 and count("ecc_uncorrected") == 1
    assert count("gpu_lost") == 0


def test_without_a_gpu_the_guard_is_always_healthy_and_samples_nothing():
    guard = GpuGuard()
    assert asyncio.run(guard.check()).verdict is Verdict.HEALTHY
    assert guard.sampler() is None


# --- what Prometheus sees --------------------------------------------------------------------
def exposition(**view: object) -> str:
    from prometheus_client import generate_latest

    from agent.metrics import NodeInfo, StatusView

    status = StatusView(state="ready", engine_up=True, engine_start_time=None,
                        states=("ready",), node=NodeInfo(), **view)  # type: ignore[arg-type]
    registry = new_registry()
    Metrics(registry, lambda: status)
    return generate_latest(registry).decode()


def test_without_a_gpu_the_peak_and_usability_have_no_sample_rather_than_zero():
    text = exposition()
    assert "# TYPE pitstop_recovery_gpu_memory_peak_bytes gauge" in text
    assert "pitstop_recovery_gpu_memory_peak_bytes{" not in text
    assert "\npitstop_gpu_usable " not in text
    assert "pitstop_gpu_faults_total{" not in text  # counted only where a GPU is watched
    # ... while the counters every host has still start at 0.
    assert 'pitstop_regenerations_total{result="failure"} 0.0' in text
    assert 'pitstop_engine_failures_total{cause="gpu_fault"} 0.0' in text


def test_the_last_peak_of_each_path_and_usability_are_exported():
    text = exposition(recovery_gpu_peak_bytes=(("cold", 5 << 30), ("hybrid", 3 << 30)),
                      gpu_usable=False)
    assert 'pitstop_recovery_gpu_memory_peak_bytes{path="hybrid"} 3.221225472e+09' in text
    assert 'pitstop_recovery_gpu_memory_peak_bytes{path="cold"} 5.36870912e+09' in text
    assert "\npitstop_gpu_usable 0.0" in text


def test_room_for_a_tree_is_the_free_memory_against_what_its_processes_use(watch, nvml):
    # 80 GiB in all, 1 GiB in use: 79 GiB free.
    nvml.gpu.processes = {100: 2 << 30, 101: 60 << 30, 200: 5 << 30}
    assert watch.room_for({100}) is True
    assert watch.room_for({100, 101}) is True      # 62 GiB fit in 79
    nvml.gpu.memory_used = 30 << 30                  # 50 GiB free
    assert watch.room_for({100, 101}) is False
    assert watch.room_for({100, 200}) is True
    # None of them on the GPU (or hidden by a PID namespace): not known, so no room.
    assert watch.room_for({300}) is False
    # A figure NVML cannot read ("not available" in a container): no room either.
    nvml.gpu.processes = {100: None}
    assert watch.room_for({100}) is False
    nvml.fall_off_the_bus()
    assert watch.room_for({100}) is False
