"""The supervisor's transition table and its backoff arithmetic."""

from __future__ import annotations

import pytest

from agent.config import parse_text
from agent.supervisor.states import TRANSITIONS, Event, State, TransitionError, next_state


def test_a_crash_while_ready_backs_off_then_starts_again():
    s = next_state(State.READY, Event.ENGINE_FAILED)
    assert s is State.BACKOFF
    assert next_state(s, Event.BACKOFF_DONE) is State.STARTING
    assert next_state(State.STARTING, Event.VERIFIED) is State.READY


def test_every_state_can_be_stopped():
    for state in State:
        if state in (State.STOPPING,):
            continue
        assert next_state(state, Event.STOP) is State.STOPPING
    assert next_state(State.STOPPING, Event.STOPPED) is State.STOPPED


def test_a_crash_loop_is_left_only_by_a_reset_or_a_stop():
    assert next_state(State.BACKOFF, Event.CRASH_LOOP) is State.FAILED
    # Failures are counted before each backoff: that is the one place a loop is found.
    assert {st for (st, ev) in TRANSITIONS if ev is Event.CRASH_LOOP} == {State.BACKOFF}
    leaving = {ev for (st, ev) in TRANSITIONS if st is State.FAILED}
    assert leaving == {Event.RESET, Event.STOP}


def test_a_gpu_that_is_gone_ends_in_failed_from_wherever_it_is_found():
    for state in (State.READY, State.SNAPSHOTTING, State.STARTING):
        assert next_state(state, Event.GPU_FAILED) is State.FAILED
    # Never into backoff: a restart cannot help, so there is no loop to back off from.
    assert {TRANSITIONS[k] for k in TRANSITIONS if k[1] is Event.GPU_FAILED} == {State.FAILED}
    assert next_state(State.FAILED, Event.RESET) is State.STARTING


def test_an_impossible_event_raises():
    with pytest.raises(TransitionError, match="no transition from stopped on verified"):
        next_state(State.STOPPED, Event.VERIFIED)


def test_every_state_is_reachable():
    targets = {State.STOPPED} | set(TRANSITIONS.values())
    assert targets == set(State)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _supervisor(clock):
    import asyncio

    from agent.metrics import Metrics, new_registry
    from agent.supervisor.canary import CanaryBook
    from agent.supervisor.gate import EngineGate
    from agent.supervisor.status import AgentStatus
    from agent.supervisor.supervisor import Supervisor
    from agent.systemd import Notifier

    cfg = parse_text("engine: {model: /m}\nrestart: {backoff_initial_s: 1, backoff_max_s: 5,"
                     " backoff_multiplier: 2, crash_loop_window_s: 60}\n", "t.yaml")

    async def make():
        return Supervisor(config=cfg, adapter=None, paths=[], gate=EngineGate(),
                          metrics=Metrics(new_registry(), lambda: None), notifier=Notifier({}),
                          status=AgentStatus(), canaries=CanaryBook(None), clock=clock)

    return asyncio.run(make())


def test_a_first_failure_restarts_at_once_and_later_ones_back_off_exponentially():
    clock = _Clock()
    sup = _supervisor(clock)
    delays = []
    for _ in range(6):
        sup.record_failure()
        delays.append(sup.backoff_delay()[0])
        clock.now += 1
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_failures_older_than_the_window_are_forgotten():
    clock = _Clock()
    sup = _supervisor(clock)
    for _ in range(4):
        sup.record_failure()
    clock.now += 61
    sup.record_failure()
    assert sup.backoff_delay() == (0.0, 1)
