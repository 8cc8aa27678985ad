"""What a GPU fault means for a recovery: the rungs it rules out, the memory the holder drops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from agent.errors import IdentityError
from agent.gpu_health import HEALTHY, GpuCheck, GpuFault, GpuWatch, PeakSampler, Verdict
from agent.metrics import Metrics
from agent.recovery import Fall
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.ladder import Attempt
from agent.supervisor.status import Fallthrough

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


def unusable(check: GpuCheck) -> str:
    """Why no restart can help with the GPU `check` found unusable, and what to do."""
    return (f"the GPU is unusable: {check.describe()}; restarting the engine cannot help. "
            "Reset or service the GPU, then restart the agent")


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
        # Samples the GPU's memory in use during a walk of the ladder (None without a GPU).
        self._sampler: PeakSampler | None = None

    def listen(self, lost: Callable[[GpuFault], None]) -> None:
        """Call `lost` on the running event loop for each fault an NVML event reports that
        leaves the GPU unusable. Memory faults wait for the engine's own failure, which
        they usually cause."""
        if self.watch is None:
            return
        loop = asyncio.get_running_loop()

        def fault(f: GpuFault) -> None:
            if f.verdict is Verdict.UNUSABLE:
                loop.call_soon_threadsafe(lost, f)

        self.watch.on_fault = fault

    async def check(self, attempt: Attempt | None = None) -> GpuCheck:
        """The GPU's faults now; before a walk (`attempt`), after a memory fault the holder
        is told to drop what it holds, and what it did is told beside the rungs it rules
        out (the attempt's fallthroughs)."""
        check = await self._check()
        if attempt is not None and check.verdict is Verdict.MEMORY_SUSPECT:
            attempt.gpu_fault = check.describe()
            dropped = await self.drop_held(check)
            attempt.fallthroughs.append(Fallthrough("holder", Fall.GPU_FAULT, Refusal(
                RefusalCode.GPU_FAULT, f"GPU fault: {attempt.gpu_fault}; {dropped}")))
        return check

    async def _check(self) -> GpuCheck:
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

    def start_sampling(self) -> None:
        """Sample the GPU's memory in use for one walk of the ladder (ending any earlier
        sampling); `stop_sampling` gives its peak."""
        self.stop_sampling()
        self._sampler = self.sampler()

    def stop_sampling(self) -> int | None:
        """The peak since `start_sampling`; None without a GPU or a sampling under way."""
        sampler, self._sampler = self._sampler, None
        return sampler.stop() if sampler is not None else None

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
