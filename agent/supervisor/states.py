"""The supervisor's states and the table of every allowed transition."""

from __future__ import annotations

from enum import StrEnum

from agent.errors import PitstopError


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    SNAPSHOTTING = "snapshotting"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    FAILED = "failed"


class Event(StrEnum):
    START = "start"
    VERIFIED = "verified"
    START_FAILED = "start_failed"
    ENGINE_FAILED = "engine_failed"
    RESTART = "restart"
    SNAPSHOT = "snapshot"
    SNAPSHOT_DONE = "snapshot_done"
    BACKOFF_DONE = "backoff_done"
    CRASH_LOOP = "crash_loop"
    RESET = "reset"
    GPU_FAILED = "gpu_failed"
    STOP = "stop"
    STOPPED = "stopped"


class TransitionError(PitstopError):
    """An event arrived in a state that has no edge for it: a bug in the supervisor."""


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    # The agent starts, walks the ladder.
    (S.STOPPED, E.START): S.STARTING,
    # Some ladder path produced an engine whose health and canary check out.
    (S.STARTING, E.VERIFIED): S.READY,
    # Every path failed, or the engine died while starting: wait, then try again.
    (S.STARTING, E.START_FAILED): S.BACKOFF,
    # Too many failures inside the crash-loop window (counted before each backoff): stop
    # trying until told to.
    (S.BACKOFF, E.CRASH_LOOP): S.FAILED,
    # A crash, an unrequested exit or a hang while serving.
    (S.READY, E.ENGINE_FAILED): S.BACKOFF,
    # A reload changed the engine's configuration: replace it through the ladder.
    (S.READY, E.RESTART): S.STARTING,
    # Taking a snapshot of a quiet, verified engine; it serves again afterwards.
    (S.READY, E.SNAPSHOT): S.SNAPSHOTTING,
    (S.SNAPSHOTTING, E.SNAPSHOT_DONE): S.READY,
    (S.SNAPSHOTTING, E.ENGINE_FAILED): S.BACKOFF,
    # Backoff over (zero for a first failure): walk the ladder again.
    (S.BACKOFF, E.BACKOFF_DONE): S.STARTING,
    # The GPU is gone or needs a reset or service (NVML said so): no restart can help, so
    # the agent stops trying instead of looping, whether the engine was serving, being
    # snapshotted or being started when that was found.
    (S.READY, E.GPU_FAILED): S.FAILED,
    (S.SNAPSHOTTING, E.GPU_FAILED): S.FAILED,
    (S.STARTING, E.GPU_FAILED): S.FAILED,
    # An operator's reload clears a crash loop, or a failed GPU once it was serviced.
    (S.FAILED, E.RESET): S.STARTING,
    # SIGTERM from anywhere: drain and stop the engine.
    (S.STOPPED, E.STOP): S.STOPPING,
    (S.STARTING, E.STOP): S.STOPPING,
    (S.READY, E.STOP): S.STOPPING,
    (S.SNAPSHOTTING, E.STOP): S.STOPPING,
    (S.BACKOFF, E.STOP): S.STOPPING,
    (S.FAILED, E.STOP): S.STOPPING,
    (S.STOPPING, E.STOPPED): S.STOPPED,
}


def next_state(state: State, event: Event) -> State:
    """The state `event` leads to from `state`; an impossible event raises."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise TransitionError(f"no transition from {state} on {event}") from None
