"""The words of a recovery: why the ladder is walked, and how a rung of it was passed over."""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    """Why the ladder is walked: the `cause` of a recovery, status and metrics."""

    STARTUP = "startup"
    CRASH = "crash"
    EXIT = "exit"
    HANG = "hang"
    # The engine failed while its GPU reported a fault (Xid, uncorrectable ECC): memory held
    # across the failure is not reused.
    GPU_FAULT = "gpu_fault"
    # After a snapshot the engine could not take back its held weights or KV pool: it is
    # alive but cannot serve, so it is replaced.
    RESUME_FAILED = "resume_failed"
    RELOAD = "reload"
    DRIFT = "drift"
    RESET = "reset"


class Fall(StrEnum):
    """How a rung of the ladder was passed over: `pitstop_ladder_fallthroughs_total{reason}`."""

    # It could not be tried now (no snapshot yet, holder gone): its refusal says why.
    SKIPPED = "skipped"
    # Not tried: it would reuse memory that a GPU fault made suspect.
    GPU_FAULT = "gpu_fault"
    START_FAILED = "start_failed"
    # The engine came up but did not give the recorded canary answer (or another model).
    VERIFY_FAILED = "verify_failed"
