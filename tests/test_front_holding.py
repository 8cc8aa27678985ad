"""Holding requests at the real EngineGate: deadlines, bounds, recoveries, stopping."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.config import QueueConfig
from agent.errors import FrontRejected
from agent.front.holding import Holding
from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from agent.supervisor.gate import EngineGate

SOCK = Path("/run/engine.sock")


def _metrics() -> Metrics:
    return Metrics(new_registry(), lambda: StatusView("running", True, None, (), NodeInfo()))


def _failed(m: Metrics, reason: str) -> float:
    return m.registry.get_sample_value("pitstop_front_failed_requests_total",
                                       {"reason": reason}) or 0.0


def test_open_gate_admits_at_once() -> None:
    async def main() -> None:
        gate = EngineGate()
        gate.open(SOCK)
        h = Holding(gate, QueueConfig(), _metrics())
        ready = await h.admit()
        assert ready.socket == SOCK and ready.recovery == 1 and h.depth == 0
    asyncio.run(main())


def test_deadline_gives_rejection_with_retry_after() -> None:
    async def main() -> None:
        m = _metrics()
        h = Holding(EngineGate(), QueueConfig(deadline_s=0.2, retry_after_s=3), m)
        with pytest.raises(FrontRejected) as e:
            await h.admit()
        assert e.value.reason == "deadline" and e.value.retry_after == 3
        assert "front.queue.deadline_s" in str(e.value)
        assert h.depth == 0 and _failed(m, "deadline") == 1
        assert m.registry.get_sample_value("pitstop_front_queue_wait_seconds_count") == 1
    asyncio.run(main())


def test_held_requests_go_when_the_gate_opens_and_the_bound_holds() -> None:
    async def main() -> None:
        gate, m = EngineGate(), _metrics()
        h = Holding(gate, QueueConfig(max_waiting=2, deadline_s=5), m)
        waiting = [asyncio.create_task(h.admit()) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert h.depth == 2 and h.would_admit() is False
        with pytest.raises(FrontRejected) as e:
            await h.admit()
        assert e.value.reason == "queue_full"
        gate.open(SOCK)
        assert [r.recovery for r in await asyncio.gather(*waiting)] == [1, 1]
        assert h.depth == 0 and h.would_admit()
    asyncio.run(main())


def test_resume_waits_for_a_later_recovery() -> None:
    async def main() -> None:
        gate = EngineGate()
        gate.open(SOCK)
        h = Holding(gate, QueueConfig(), _metrics())
        # The engine of recovery 1 died under us, but the gate has not closed yet.
        task = asyncio.create_task(h.resume(lost=1, timeout=5))
        await asyncio.sleep(0.05)
        assert not task.done() and h.depth == 1
        gate.close("crashed")
        gate.open(SOCK)
        assert (await task).recovery == 2 and h.depth == 0
        assert await h.resume(lost=2, timeout=0.05) is None
    asyncio.run(main())


def test_cancelled_waiter_frees_its_place() -> None:
    async def main() -> None:
        h = Holding(EngineGate(), QueueConfig(max_waiting=1, deadline_s=5), _metrics())
        task = asyncio.create_task(h.admit())
        await asyncio.sleep(0.05)
        assert h.depth == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert h.depth == 0
    asyncio.run(main())


def test_stop_rejects_waiting_and_new_requests() -> None:
    async def main() -> None:
        m = _metrics()
        h = Holding(EngineGate(), QueueConfig(deadline_s=5), m)
        task = asyncio.create_task(h.admit())
        await asyncio.sleep(0.05)
        h.stop()
        with pytest.raises(FrontRejected) as e:
            await task
        assert e.value.reason == "draining" and h.depth == 0
        with pytest.raises(FrontRejected):
            await h.admit()
        assert _failed(m, "draining") == 2 and not h.would_admit()
    asyncio.run(main())


def test_ready_turns_false_after_a_long_outage() -> None:
    async def main() -> None:
        gate = EngineGate()
        gate.open(SOCK)
        h = Holding(gate, QueueConfig(deadline_s=0.1), _metrics())
        gate.close("crashed")
        assert h.would_admit()       # a restore: held requests will be served
        await asyncio.sleep(0.15)
        assert not h.would_admit()   # longer than a deadline: route elsewhere
        gate.open(SOCK)
        gate.pause_admission()       # a snapshot: requests are held a moment, not refused
        assert gate.current is None and h.would_admit()
    asyncio.run(main())
