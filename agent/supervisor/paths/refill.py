"""Refill, then hybrid: the holder lost the weights but the hybrid image still matches."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.config import Config
from agent.errors import HolderError, StartPathError
from agent.holder.client import HolderClient
from agent.holder.plans import RefillPlans, load_timeout
from agent.holder.protocol import Refilled
from agent.holder.weightplan import PlanSource, RefillPlan
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.holder import HolderLink, HybridRestore

log = logging.getLogger("pitstop.refill")


@dataclass(frozen=True)
class RefillWork:
    """What the refill rung's prepare found: the plan the holder loads, then the hybrid
    image restored over it (the hybrid rung's own preparation of it)."""

    plan: RefillPlan
    image: Prepared[Manifest]


class RefillRestore:
    """Make the holder load the weights from the model's files, then restore the hybrid image.

    For a holder that is up but empty (restarted, rebooted, or told to drop everything
    after a GPU fault) while the newest hybrid image matches the host: the holder reads
    the files named by the refill plan it keeps beside its socket, into new regions that
    no one can attach until all are loaded and committed; the restored engine then
    re-attaches them by digest at the addresses it had. The restore itself is `hybrid`'s
    (a HybridRestore of its own), started once the holder holds the weights again.

    It reuses no held memory (the regions are new), so it stays on the ladder after a GPU
    fault, once the holder dropped what it held.

    Benches reach it by restarting the holder empty (`systemctl restart
    pitstop-holder@GPU`, or a new `pitstop holder` with `--no-refill`) and killing the
    engine: the ladder skips hybrid ("held region ... is gone") and serves from here;
    `last_recovery.stages.refill` is the load, the rest the hybrid restore.

    Example::

        refill = RefillRestore(HybridRestore(link, ...), link, RefillPlans(model, digester))
        ladder = [hybrid, refill, full, ...]
        refill.remember(digest)   # once an engine is ready: the plan a holder refills from
    """

    name = "refill"
    reuses_held_memory = False

    def __init__(self, hybrid: HybridRestore, link: HolderLink, plans: RefillPlans,
                 on_refilled: Callable[[int, float], None] = lambda n, s: None) -> None:
        self._hybrid = hybrid
        self._link = link
        self._plans = plans
        self._on_refilled = on_refilled

    async def prepare(self, attempt: Attempt) -> Prepared[RefillWork] | Refusal:
        # Asking the holder, reading the plan and stat-ing (or hashing) its files block.
        return await asyncio.to_thread(self._choose)

    def _choose(self) -> Prepared[RefillWork] | Refusal:
        link = self._link
        refusal = (link.unavailable() or self._hybrid.image_refusal()
                   or self._hybrid.one_worker_refusal(self.name))
        if refusal is not None:
            return refusal
        if not link.config.refill:
            return Refusal(RefusalCode.DISABLED, "refill is off (holder.refill: false)")
        try:
            if link.holds_weights():
                return Refusal(RefusalCode.WEIGHTS_HELD, "the holder holds the weights "
                               "already; nothing to refill")
        except HolderError as e:
            return Refusal(RefusalCode.HOLDER_DOWN,
                           f"the holder at {link.path} cannot tell what it holds: {e}")
        plan = self._plans.usable(link.path.parent, str(link.digest))
        if isinstance(plan, Refusal) and plan.code is not RefusalCode.NO_REFILL_PLAN:
            return plan
        image = self._hybrid.newest_image()
        if isinstance(image, Refusal):
            return image
        if isinstance(plan, Refusal) or \
                sorted(r.name for r in plan.regions) != sorted(image.plan.held or {}):
            # None for the image's regions here (a pulled image, a wiped holder directory).
            plan = self._from_image(image.plan, plan)
        if isinstance(plan, Refusal):
            return plan
        return Prepared(self.name, RefillWork(plan, image), canary=image.canary,
                        stages=image.stages)

    def _from_image(self, manifest: Manifest, plan: RefillPlan | Refusal) -> RefillPlan | Refusal:
        """The plan of the image's own recipe when the holder's directory has none for its
        regions (written there, for the holder to load); else why not."""
        link = self._link
        if manifest.refill is not None:
            return self._plans.from_recipe(link.path.parent, manifest.refill, str(link.digest))
        if isinstance(plan, Refusal):
            return plan
        if plan.source is PlanSource.FILES:
            return Refusal(RefusalCode.NO_REFILL_RECIPE, f"snapshot {manifest.id} holds its "
                           "weights in the engine's own layout, not the files', and carries no "
                           "refill recipe (the node that made it could not make one that "
                           "rebuilds them; its log says why)")
        return Refusal(RefusalCode.REFILL_LAYOUT, "the refill plan's regions are not the "
                       "ones the hybrid image recorded")

    async def start(self, attempt: Attempt, prepared: Prepared[RefillWork]) -> EngineProcess:
        plan, image = prepared.plan.plan, prepared.plan.image
        manifest = image.plan
        timeout = load_timeout(plan.bytes)
        with attempt.stage("refill"):
            try:
                done = await asyncio.to_thread(self._refill, plan.digest, timeout)
            except HolderError as e:
                # The image is not at fault: it stays, and the ladder falls to a full restore.
                raise StartPathError(Refusal(RefusalCode.REFILL_FAILED,
                                             f"refill of {plan.digest} failed: {e}")) from e
        log.info("refill: %d bytes in %.2fs (%.2f GB/s); restoring %s", done.bytes,
                 done.seconds, done.gbps, manifest.id)
        self._on_refilled(done.bytes, done.seconds)
        stale = await asyncio.to_thread(self._link.stale_reason, manifest.held or {})
        if stale is not None:
            raise StartPathError(Refusal(RefusalCode.HELD_STALE, f"after the refill the held "
                                         f"weights do not match the image: {stale}"))
        return await self._hybrid.start(attempt, image)

    def start_limit_s(self, prepared: Prepared[RefillWork]) -> float:
        return load_timeout(prepared.plan.plan.bytes) + \
            self._hybrid.start_limit_s(prepared.plan.image)

    async def after_verified(self, engine: EngineProcess,
                             prepared: Prepared[RefillWork]) -> None:
        return None

    async def failed(self, prepared: Prepared[RefillWork], reason: str) -> None:
        await self._hybrid.failed(prepared.plan.image, reason)

    def reconfigure(self, config: Config) -> None:
        """The restore's resume limit, as a reload left it (holder.refill is the link's)."""
        self._hybrid.reconfigure(config)

    def remember(self, digest: str) -> Path | None:
        """Leave a refill plan for `digest` in the holder's directory when refill is on and
        the holder holds those weights; the path written, or None. Blocking: call it from
        a thread."""
        if not self._link.config.refill or self._link.unavailable() is not None:
            return None
        return self._plans.remember(self._link.path, digest)

    def _refill(self, digest: str, timeout: float) -> Refilled:
        with HolderClient(self._link.path, timeout=timeout) as c:
            return c.refill(digest)
