"""The supervisor and a faulting GPU: the real reference engine and holder, NVML faked.

The GPU's NVML is the fake of tests/fake_nvml.py, passed to the watch as its module; the
engine, the holder and the supervisor are the real ones.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.errors import StartPathError
from agent.gpu_health import GpuWatch
from agent.metrics import Metrics, StatusView, new_registry
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.canary import CanaryBook
from agent.supervisor.engine import EngineProcess
from agent.supervisor.gate import EngineGate
from agent.supervisor.gpu import GpuGuard
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.paths.holder import HolderLink, WarmStart
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.fake_nvml import FakeNvml
from tests.frontkit import socket_dir
from tests.holder_proc import Holder

pytestmark = pytest.mark.integration

DIGEST = "sha256-gpufaulttest"


class HeldImageRung:
    """Stands in for the hybrid restore (it needs CRIU): always worth a try, never starts."""

    name = "hybrid"
    reuses_held_memory = True

    def __init__(self) -> None:
        self.tried = 0

    async def prepare(self, attempt: Attempt) -> Prepared[None]:
        return Prepared(self.name, None)

    async def start(self, attempt: Attempt, prepared: Prepared[None]):
        self.tried += 1
        raise StartPathError(Refusal(RefusalCode.RESTORE_FAILED, "no hybrid image in this test"))

    def start_limit_s(self, prepared: Prepared[None]) -> float:
        return 0.0

    async def after_verified(self, engine, prepared: Prepared[None]) -> None:
        return None

    async def failed(self, prepared: Prepared[None], reason: str) -> None:
        return None


@dataclass
class Node:
    sup: Supervisor
    status: AgentStatus
    metrics: Metrics
    holder: Holder
    hybrid: HeldImageRung
    nvml: FakeNvml

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def wait(self, cond: Callable[[AgentStatus], bool], what: str,
                   timeout: float = 120) -> AgentStatus:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not cond(self.status):
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {self.status}")
            await asyncio.sleep(0.05)
        return self.status

    async def ready(self, restarts: int) -> AgentStatus:
        return await self.wait(lambda s: s.state == "ready" and s.restarts == restarts,
                               f"ready after {restarts} restarts")

    def kill_engine(self) -> None:
        assert self.status.engine_pid is not None
        os.kill(self.status.engine_pid, signal.SIGKILL)


@asynccontextmanager
async def node(tiny_model: Path, nvml: FakeNvml) -> AsyncIterator[Node]:
    d = socket_dir()
    holder = Holder(d / "holder")
    cfg = parse_config(agent_config(d, tiny_model, holder={
        "enabled": True, "dir": str(d / "holder"), "gpu": "cpu"}), "test")
    adapter = build_adapter(cfg)
    status = AgentStatus()
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    link = HolderLink(cfg.holder, cfg.paths.run, gpu=lambda: "cpu", digest=lambda: DIGEST,
                      adapter=adapter)
    watch = GpuWatch(0, nvml=nvml, wait_ms=20)
    watch.start()
    metrics.gpu_watched()
    hybrid = HeldImageRung()
    sup = Supervisor(
        config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=status, canaries=CanaryBook(d / "canary.json"),
        paths=[hybrid, WarmStart(adapter, link), ColdStart(adapter, extra_args=link.engine_args)],
        gpu=GpuGuard(watch, drop_held=link.drop, metrics=metrics))
    run = asyncio.ensure_future(sup.run())
    try:
        yield Node(sup, status, metrics, holder, hybrid, nvml)
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
        watch.close()
        holder.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_a_crash_with_a_gpu_fault_takes_no_rung_that_reuses_held_memory(tiny_model):
    nvml = FakeNvml()

    async def main() -> None:
        async with node(tiny_model, nvml) as n:
            await n.ready(0)
            assert n.status.last_recovery.path == "cold"  # and it filled the holder
            assert n.holder.stats().regions_committed > 0
            nvml.gpu.memory_used = 3 << 30
            n.kill_engine()
            st = await n.ready(1)
            # Without a fault the held weights are reused: the warm start takes them.
            assert st.last_recovery.path == "warm" and st.last_recovery.cause == "crash"
            # The GPU's memory in use at its peak, sampled during each recovery, by path.
            assert st.last_recovery.gpu_peak_bytes == 3 << 30
            assert st.gpu_peak_bytes == {"cold": 1 << 30, "warm": 3 << 30}
            # The front learns which rung started the engine it forwards to.
            assert n.sup.gate.current is not None and n.sup.gate.current.path == "warm"
            tried = n.hybrid.tried

            nvml.xid(48)
            n.kill_engine()
            st = await n.ready(2)
            rec = st.last_recovery
            assert (rec.path, rec.cause) == ("cold", "gpu_fault")
            assert rec.gpu_fault == "Xid 48 (double-bit ECC error)"
            assert n.hybrid.tried == tried  # not even tried
            falls = " | ".join(map(str, rec.fallthroughs))
            assert {(f.path, f.kind, f.refusal.code) for f in rec.fallthroughs} >= {
                ("holder", "gpu_fault", "gpu_fault"), ("hybrid", "gpu_fault", "gpu_fault"),
                ("warm", "gpu_fault", "gpu_fault")}
            assert "GPU fault: Xid 48 (double-bit ECC error); the holder dropped its" in falls
            assert ("hybrid gpu fault: GPU fault (Xid 48 (double-bit ECC error)): the memory it "
                    "would reuse may be corrupt") in falls
            assert "warm gpu fault: GPU fault (Xid 48" in falls
            log = n.holder.log.read_text()
            assert "(gpu_fault): Xid 48 (double-bit ECC error)" in log
            # The cold start loaded the weights from disk into the holder again.
            assert n.holder.stats().regions_committed > 0
            assert n.sample("pitstop_engine_failures_total", cause="gpu_fault") == 1
            assert n.sample("pitstop_recoveries_total", path="cold", result="success",
                            cause="gpu_fault") == 1
            assert n.sample("pitstop_ladder_fallthroughs_total", path="warm",
                            reason="gpu_fault") == 1
            assert n.sample("pitstop_gpu_faults_total", kind="xid_memory") == 1

            # Dealt with: the next crash reuses the (new) held weights again.
            n.kill_engine()
            st = await n.ready(3)
            assert (st.last_recovery.path, st.last_recovery.cause) == ("warm", "crash")
            assert st.last_recovery.gpu_fault == ""
            assert st.gpu == "healthy"

    asyncio.run(main())


def test_a_dead_engines_tree_is_killed_while_the_gpu_is_read_and_the_status_says_when(
        tiny_model, monkeypatch):
    # Neither waits for the other: the GPU's health read after a crash (NVML, which can take
    # a while) runs while the dead tree is killed and waited for.
    nvml = FakeNvml()
    crashed, killing = threading.Event(), threading.Event()
    seen: list[bool] = []
    real_kill, real_check = EngineProcess.kill, GpuWatch.check

    async def kill(self: EngineProcess):
        killing.set()
        return await real_kill(self)

    def check(self: GpuWatch):
        if crashed.is_set():
            crashed.clear()
            # Read before the kill began, this would wait its whole 10 s in vain.
            seen.append(killing.wait(10))
        return real_check(self)

    monkeypatch.setattr(EngineProcess, "kill", kill)
    monkeypatch.setattr(GpuWatch, "check", check)

    async def main() -> None:
        async with node(tiny_model, nvml) as n:
            st = await n.ready(0)
            assert st.last_recovery.down_at is None and st.last_recovery.lead_s == {}
            killed_at = time.time()
            crashed.set()
            n.kill_engine()
            rec = (await n.ready(1)).last_recovery
            assert seen == [True]
            # When the agent saw the death, and what passed before its decision: the
            # client's seconds that its duration_s leaves out.
            assert killed_at <= rec.down_at <= rec.at - rec.duration_s
            assert set(rec.lead_s) == {"teardown"}  # a first failure: no backoff
            assert 0 <= rec.lead_s["teardown"] <= rec.at - rec.duration_s - rec.down_at

    asyncio.run(main())


def test_a_gpu_that_fell_off_the_bus_ends_in_failed_with_the_reason_not_a_restart_loop(
        tiny_model):
    nvml = FakeNvml()

    async def main() -> None:
        async with node(tiny_model, nvml) as n:
            await n.ready(0)
            nvml.fall_off_the_bus()
            n.kill_engine()
            st = await n.wait(lambda s: s.state == "failed", "the failed state")
            assert st.reason.startswith("the GPU is unusable: NVML: the GPU is lost (fallen "
                                        "off the bus); restarting the engine cannot help")
            assert st.gpu == "unusable" and st.engine_pid is None
            await asyncio.sleep(1.0)
            assert (st.state, st.restarts) == ("failed", 1)  # and it stays there
            assert n.sample("pitstop_engine_failures_total", cause="gpu_fault") == 1
            assert n.sample("pitstop_gpu_faults_total", kind="gpu_lost") >= 1
            # A reload after the GPU was serviced tries again, and finds it still lost.
            since = st.state_since
            n.sup.request_reset()
            st = await n.wait(lambda s: s.state == "failed" and s.state_since > since,
                              "a new walk, failed again", timeout=10)
            assert "the GPU is lost" in st.reason and st.restarts == 1

    asyncio.run(main())


def test_a_gpu_lost_under_a_serving_engine_stops_it_without_waiting_for_its_health_checks(
        tiny_model):
    nvml = FakeNvml()

    async def main() -> None:
        async with node(tiny_model, nvml) as n:
            st = await n.ready(0)
            pid = st.engine_pid
            # The engine process lives on and would answer /health: only NVML knows.
            nvml.xid(79)
            st = await n.wait(lambda s: s.state == "failed", "the failed state", timeout=10)
            assert st.reason == ("the GPU is unusable: Xid 79 (GPU has fallen off the bus); "
                                 "restarting the engine cannot help. Reset or service the GPU, "
                                 "then restart the agent")
            assert st.engine_pid is None and not os.path.exists(f"/proc/{pid}/status")
            assert n.sample("pitstop_engine_failures_total", cause="gpu_fault") == 1

    asyncio.run(main())


@pytest.mark.parametrize(("gpu", "said"), [
    ({"remap_pending": True}, "a row remapping is pending: the GPU needs a reset"),
    ({"lost": True}, "NVML: the GPU is lost (fallen off the bus)"),
])
def test_a_gpu_that_is_lost_or_needs_a_reset_at_startup_starts_no_engine(tiny_model, gpu, said):
    nvml = FakeNvml()
    for k, v in gpu.items():
        setattr(nvml.gpu, k, v)

    async def main() -> None:
        async with node(tiny_model, nvml) as n:
            st = await n.wait(lambda s: s.state == "failed", "the failed state", timeout=30)
            assert st.reason.startswith(f"the GPU is unusable: {said}")
            assert st.engine_pid is None and n.status.last_recovery is None
            assert n.hybrid.tried == 0

    asyncio.run(main())
