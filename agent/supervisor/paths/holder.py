"""The rungs that use the GPU memory holder: hybrid restore and warm start."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from agent.checkpoint.snapshotter import Snapshotter
from agent.config import Config, HolderConfig
from agent.engines.base import EngineAdapter
from agent.errors import HolderError
from agent.holder.client import HolderClient, holder_available, stale_reason
from agent.holder.protocol import DropReason, socket_path
from agent.identity import Identity
from agent.metrics import Metrics
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.cold import ColdStart, ExtraArgs
from agent.supervisor.paths.restore import FullRestore

log = logging.getLogger("pitstop.holder")


class HolderLink:
    """Where the holder for this engine's GPU listens, and whether it holds our weights.

    Example::

        link = HolderLink(config.holder, config.paths.run, gpu=lambda: "cpu", digest=...,
                          adapter=adapter)
        link.unavailable()  # None, or why the holder rungs are skipped

    Each question is a round trip on the holder's socket (blocking, up to 2 s): the rungs
    ask from a worker thread, never on the event loop.
    """

    def __init__(self, config: HolderConfig, run_dir: Path, gpu: Callable[[], str | None],
                 digest: Callable[[], str | None], adapter: EngineAdapter) -> None:
        self.config = config
        self._run_dir = run_dir
        self._gpu = gpu
        self._digest = digest
        # The engine decides how it maps held weights (its flags), and whether it can here
        # (vLLM: the Pitstop plugin installed in its interpreter, a vLLM the plugin supports).
        self._adapter = adapter
        # (weights digest, why) of the last start over the holder that failed.
        self._failed: tuple[str | None, str] | None = None

    def reconfigure(self, config: Config) -> None:
        """holder.refill and the rest of the holder section, as a reload left them; a
        reload also tries the holder again after a start over it failed."""
        self.config = config.holder
        self._failed = None

    def start_failed(self, reason: str) -> None:
        """A start given the holder's flags failed: later starts of the same weights load
        from disk, and the holder rungs are skipped, until a reload."""
        self._failed = (self._digest(), reason)
        log.warning("a start over the holder failed (%s): the next starts load the weights "
                    "from disk without it, until the weights change or the configuration is "
                    "reloaded", reason)

    def bypassed(self) -> bool:
        """Whether starts go without the holder because the last one over it failed."""
        return self._bypass_reason() is not None

    def _bypass_reason(self) -> str | None:
        """Why the last start over the holder failed, while that still holds (same weights,
        no reload since)."""
        if self._failed is None or self._failed[0] != self._digest():
            return None
        return self._failed[1]

    @property
    def path(self) -> Path:
        gpu = self.config.gpu if self.config.gpu != "auto" else (self._gpu() or "cpu")
        return Path(socket_path(str(self.config.dir or self._run_dir / "holder"), gpu))

    @property
    def digest(self) -> str | None:
        """The weights digest of this start: what the held regions are named by."""
        return self._digest()

    def unavailable(self) -> Refusal | None:
        if not self.config.enabled:
            return Refusal(RefusalCode.DISABLED, "no holder configured (holder.enabled: false)")
        why = self._bypass_reason()
        if why is not None:
            return Refusal(RefusalCode.HELD_START_FAILED,
                           f"the last start over the holder failed ({why}); starts "
                           "load from disk until the weights change or the configuration is "
                           "reloaded (pitstop reload, or systemctl reload pitstop-agent)")
        refusal = self._adapter.holder_refusal()
        if refusal is not None:
            return refusal
        if not self._digest():
            return Refusal(RefusalCode.NO_WEIGHTS_DIGEST,
                           "no weights digest to name the held regions by")
        reason = holder_available(self.path)
        if reason is None:
            return None
        return Refusal(RefusalCode.HOLDER_DOWN, f"holder at {self.path} does not answer: {reason}")

    def engine_args(self) -> list[str]:
        """The engine's holder flags when a holder answers; none (load from disk) otherwise."""
        return [] if self.unavailable() is not None else self.flags()

    def flags(self) -> list[str]:
        """The engine's holder flags, for a rung that already knows the holder answers."""
        return self._adapter.holder_args(self.path, str(self._digest()))

    def drop(self, detail: str) -> str:
        """Make the holder free everything it holds after a GPU fault; what it did, in words.

        Raises HolderError when a holder answers but the drop fails: its memory stays suspect.
        """
        if not self.config.enabled:
            return "no holder configured, nothing held to drop"
        if holder_available(self.path) is not None:
            return f"no holder answers at {self.path}, nothing held to drop"
        with HolderClient(self.path) as c:
            d = c.drop(DropReason.GPU_FAULT, detail)
        return f"the holder dropped its {d.regions} regions ({d.bytes / 2**30:.2f} GiB)"

    def holds_weights(self) -> bool:
        """Whether the holder holds every set of this start's weights: one, or one per
        tensor-parallel rank (each rank's loader attaches its own)."""
        return self.held_regions() is not None

    def held_regions(self) -> list[str] | None:
        """The names of the committed regions of every set of this start's weights; None
        when the holder lacks any of the sets."""
        names: list[str] = []
        with HolderClient(self.path) as c:
            for key in self._adapter.held_keys(str(self._digest())):
                regions = c.committed_set(key)
                if regions is None:
                    return None
                names += [r.name for r in regions]
        return names

    def stale_reason(self, held: dict) -> str | None:
        with HolderClient(self.path) as c:
            return stale_reason(c, held)


class ColdOverHolder(ColdStart):
    """The cold start, holding the weights it loads when a holder answers.

    One that fails with the holder's flags (an engine whose load over the holder does not
    fit the GPU, a holder that cannot allocate) makes the next ones load without them: the
    engine serves from its own copy, and the holder rungs wait for a reload.
    """

    def __init__(self, adapter: EngineAdapter, link: HolderLink,
                 suspect: Callable[[], bool] = lambda: False) -> None:
        # Held memory a GPU fault made suspect, the holder not having dropped it: load
        # from disk, not from the holder.
        super().__init__(adapter, extra_args=lambda: [] if suspect() else link.engine_args())
        self._link = link

    async def failed(self, prepared: Prepared[ExtraArgs], reason: str) -> None:
        if prepared.plan:
            self._link.start_failed(reason)


class WarmStart(ColdStart):
    """Start the engine fresh, mapping weights the holder already has instead of reading disk."""

    name = "warm"
    reuses_held_memory = True

    def __init__(self, adapter: EngineAdapter, link: HolderLink) -> None:
        super().__init__(adapter)
        self._link = link

    async def prepare(self, attempt: Attempt) -> Prepared[ExtraArgs] | Refusal:
        return await asyncio.to_thread(self._choose)

    def _choose(self) -> Prepared[ExtraArgs] | Refusal:
        refusal = self._link.unavailable()
        if refusal is not None:
            return refusal
        try:
            held = self._link.held_regions()
        except HolderError as e:
            return Refusal(RefusalCode.HOLDER_DOWN,
                           f"the holder at {self._link.path} cannot tell what it holds: {e}")
        if held is None:
            return Refusal(RefusalCode.WEIGHTS_NOT_HELD,
                           "the holder holds no committed weights of this model yet")
        return self._adapter.warm_refusal(held) or Prepared(self.name, tuple(self._link.flags()))


class HybridRestore(FullRestore):
    """Restore a small image taken with the weights detached, then map the held weights again.

    The image holds the engine, not its weights, so its restore takes
    about a second whatever the model's size; the engine re-attaches the holder's regions
    at the addresses it had (POST /pitstop/resume).
    """

    name = "hybrid"
    reuses_held_memory = True
    kind = "hybrid"

    def __init__(self, link: HolderLink, *, snapshotter: Snapshotter | None, unavailable: str,
                 adapter: EngineAdapter, socket: os.PathLike, identity: Callable[[], Identity],
                 metrics: Metrics, timeout_s: float,
                 capture_failure: Callable[[], str] = lambda: "") -> None:
        super().__init__(snapshotter=snapshotter, unavailable=unavailable, adapter=adapter,
                         socket=socket, identity=identity, metrics=metrics,
                         timeout_s=timeout_s, capture_failure=capture_failure)
        self._link = link

    def newest_image(self) -> Prepared[Manifest] | Refusal:
        """The newest hybrid image of this host that records held regions, whatever the
        holder holds now (the refill loads them first); blocking (it verifies files)."""
        chosen = super()._choose()
        if isinstance(chosen, Refusal):
            return chosen
        if not chosen.plan.held:
            return Refusal(RefusalCode.NO_HELD_REGIONS,
                           "the newest hybrid snapshot records no held regions")
        return chosen

    def _choose(self) -> Prepared[Manifest] | Refusal:
        refusal = self._link.unavailable()
        if refusal is not None:
            return refusal
        chosen = self.newest_image()
        if isinstance(chosen, Refusal):
            return chosen
        try:
            stale = self._link.stale_reason(chosen.plan.held or {})
        except HolderError as e:
            # It answered a moment ago (unavailable() above) and no longer does, or answers
            # what this agent cannot read: a reason to take the next rung, not to exit.
            return Refusal(RefusalCode.HOLDER_DOWN,
                           f"the holder at {self._link.path} cannot tell what it holds: {e}")
        if stale is not None:
            return Refusal(RefusalCode.HELD_STALE, stale)
        return chosen
