"""What a GPU fault means for a recovery: the rungs it rules out, the memory the holder drops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from agent.errors import IdentityError
from agent.gpu_health import HEALTHY, GpuCheck, GpuFault, GpuWatch, PeakSampler, Verdict
from agent.metrics import Metrics
from agent.refusal import Refusal, RefusalCode

log = logging.getLogger("pitstop.gpu")

# Often enough to catch the peak of a restore that takes a second, rare enough to cost nothing.
SAMPLE_EVERY_S = 0.05


class Rung(Protocol):
    name: str
    # True for a rung whose engine would use memory that outlived the failed engine (the
    # holder's weights, vLLM's preload daemon): after a GPU fault that memory may be corrupt.
    reuses_held_memory: bool


def ruled_out(rung: Rung, check: GpuCheck) -> Refusal | None:
    """Why `rung` must not be tried after the faults in `check`; None when it may be."""
    if check.verdict is Verdict.HEALTHY or not rung.reuses_held_memory:
        return None
    return Refusal(RefusalCode.GPU_FAULT,
                   f"GPU fault ({check.describe()}): the memory it would reuse may be corrupt")


class GpuGuard:
    """The supervisor's view of the engine's GPU; without a watch (no GPU) always healthy.

    Example::

        guard = GpuGuard(watch, drop_held=link.drop, metrics=metrics)
        check = await guard.check()          # off the event loop
        if check.verdict is Verdict.MEMORY_SUSPECT:
            said = await guard.drop_held(check)
        guard.acknowledge()                  # once an engine is verified again
    """

    def __init__(self, watch: GpuWatch | None = None, *,
                 drop_held: Callable[[str], str] | None = None,
                 metrics: Metrics | None = None) -> None:
        self.watch = watch
        self._drop = drop_held
        self._metrics = metrics
        # Faults already counted in pitstop_gpu_faults_total: each event once, each finding of
        # the health read once until the faults are acknowledged.
        self._counted: set[tuple[object, ...]] = set()
        # Set when held memory is suspect and the holder could not be told to drop it: no
        # engine may be pointed at the holder until a check is acknowledged.
        self.held_suspect = False
        self.last: GpuCheck = HEALTHY

    def listen(self, callback: Callable[[GpuFault], None]) -> None:
        """Call `callback` on the running event loop for each fault an NVML event reports."""
        if self.watch is None:
            return
        loop = asyncio.get_running_loop()
        self.watch.on_fault = lambda fault: loop.call_soon_threadsafe(callback, fault)

    async def check(self) -> GpuCheck:
        if self.watch is None:
            return HEALTHY
        try:
            check = await asyncio.to_thread(self.watch.check)
        except IdentityError as e:
            # NVML misbehaving is not a verdict on the GPU: say so, and go on as before.
            log.error("%s; treating the GPU as healthy", e)
            return HEALTHY
        for f in check.faults:
            key = (f.kind, f.detail, f.at) if f.event else (f.kind,)
            if key not in self._counted and self._metrics is not None:
                self._counted.add(key)
                self._metrics.gpu_faults.labels(kind=f.kind.value).inc()
        self.last = check
        return check

    async def drop_held(self, check: GpuCheck) -> str:
        """Tell the holder to drop every allocation of this GPU; what happened, in words."""
        if self._drop is None:
            return "no holder to drop"
        try:
            said = await asyncio.to_thread(self._drop, check.describe())
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the memory stays suspect
            self.held_suspect = True
            log.error("could not make the holder drop its memory after a GPU fault: %s", e)
            return f"the holder could not be told to drop its memory ({e})"
        log.warning("GPU fault: %s", said)
        return said

    def acknowledge(self) -> None:
        """The faults of the last check were dealt with: an engine that reuses no suspect
        memory is verified, or an operator reset the agent. Later ones stay pending."""
        check, self.last = self.last, HEALTHY
        self.held_suspect = False
        self._counted = {k for k in self._counted if len(k) > 1}
        if self.watch is not None:
            self.watch.acknowledge(check)

    def sampler(self) -> PeakSampler | None:
        """A started sampler of the GPU's memory in use; None without a GPU."""
        if self.watch is None:
            return None
        return PeakSampler(self.watch.memory_used, SAMPLE_EVERY_S).start()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
