"""Refill, then hybrid: the holder lost the weights but the hybrid image still matches."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from agent import commands
from agent.errors import (
    CommandError,
    HolderError,
    HolderRefusedError,
    ModelError,
    StartPathError,
    WeightsError,
)
from agent.holder.client import HolderClient
from agent.holder.heldcopy import COPY_DIR, COPYABLE_BACKENDS
from agent.holder.protocol import RegionInfo
from agent.holder.weightplan import (
    PLAN_NAME,
    DriftCode,
    PlanSource,
    RefillPlan,
    load_plan,
    plan_for,
    write_plan,
)
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.holder import HolderLink, HybridRestore
from agent.supervisor.paths.restore import FullRestore
from agent.weights import WeightsDigester

log = logging.getLogger("pitstop.refill")

# The slowest refill worth waiting for, in bytes a second: a cold NVMe or a network disk.
# The holder answers when the load ends; the client's timeout must outlast it.
SLOWEST_RATE = 100e6
MIN_TIMEOUT_S = 60.0
# Room left on the holder's file system beside a copy of the held weights.
COPY_HEADROOM = 1 << 30


def load_timeout(nbytes: int) -> float:
    """How long loading (or copying) `nbytes` of weights may take at the slowest rate worth
    waiting for."""
    return max(MIN_TIMEOUT_S, nbytes / SLOWEST_RATE)


@dataclass(frozen=True)
class RefillWork:
    """What the refill rung's prepare found: the plan the holder loads, then the hybrid
    image restored over it (the hybrid rung's own preparation of it)."""

    plan: RefillPlan
    image: Prepared[Manifest]


class RefillRestore(HybridRestore):
    """Make the holder load the weights from the model's files, then restore the hybrid image.

    For a holder that is up but empty (restarted, rebooted, or told to drop everything
    after a GPU fault) while the newest hybrid image matches the host: the holder reads
    the files named by the refill plan it keeps beside its socket, into new regions that
    no one can attach until all are loaded and committed; the restored engine then
    re-attaches them by digest at the addresses it had.

    It reuses no held memory (the regions are new), so it stays on the ladder after a GPU
    fault, once the holder dropped what it held.

    Benches reach it by restarting the holder empty (`systemctl restart
    pitstop-holder@GPU`, or a new `pitstop holder` with `--no-refill`) and killing the
    engine: the ladder skips hybrid ("held region ... is gone") and serves from here;
    `last_recovery.stages.refill` is the load, the rest the hybrid restore.
    """

    name = "refill"
    reuses_held_memory = False
    kind = "hybrid"

    def __init__(self, link: HolderLink, *, enabled: bool, model: Path,
                 digester: Callable[[], WeightsDigester],
                 on_refilled: Callable[[int, float], None] = lambda n, s: None,
                 **kwargs: object) -> None:
        super().__init__(link, **kwargs)
        self.enabled = enabled
        self._model = model
        self._digester = digester
        self._on_refilled = on_refilled
        self._run: commands.Runner = commands.run

    async def prepare(self, attempt: Attempt) -> Prepared[RefillWork] | Refusal:  # type: ignore[override]
        # Asking the holder, reading the plan and stat-ing (or hashing) its files block.
        return await asyncio.to_thread(self._choose)

    def _choose(self) -> Prepared[RefillWork] | Refusal:  # type: ignore[override]
        refusal = self._link.unavailable()
        if refusal is not None:
            return refusal
        if not self.enabled:
            return Refusal(RefusalCode.DISABLED, "refill is off (holder.refill: false)")
        try:
            if self._link.holds_weights():
                return Refusal(RefusalCode.WEIGHTS_HELD, "the holder holds the weights "
                               "already; nothing to refill")
            plan = load_plan(self._link.path.parent)
        except HolderError as e:
            return Refusal(RefusalCode.HOLDER_DOWN,
                           f"the holder at {self._link.path} cannot tell what it holds: {e}")
        except ModelError as e:
            return Refusal(RefusalCode.NO_REFILL_PLAN, str(e))
        if plan is None:
            return Refusal(RefusalCode.NO_REFILL_PLAN,
                           f"no refill plan in {self._link.path.parent} (the agent writes one "
                           "once an engine committed its weights)")
        # The digest the agent took for this start (as every start does: files whose stat
        # changed are hashed again) against the one the plan's files made.
        digest = self._link.digest
        if plan.digest != digest:
            drift = plan.drift()
            return Refusal(RefusalCode.WEIGHTS_CHANGED,
                           f"the weights on disk ({digest}) are not the ones the refill plan "
                           f"names ({plan.digest})" + (f": {drift}" if drift else ""))
        drift = plan.drift()
        if drift is not None and drift.code is DriftCode.CHANGED \
                and plan.source is PlanSource.FILES:
            # Same digest, other stat (a file touched or copied back): the bytes are the
            # plan's; a fresh plan records the keys they have now.
            plan = self._fresh_plan(digest) or plan
            drift = plan.drift()
        if drift is not None:
            return Refusal(RefusalCode.WEIGHTS_CHANGED, f"the weights changed on disk since "
                           f"the refill plan was made: {drift}")
        image = FullRestore._choose(self)  # the newest matching hybrid image
        if isinstance(image, Refusal):
            return image
        held = image.plan.held
        if not held:
            return Refusal(RefusalCode.NO_HELD_REGIONS,
                           "the newest hybrid snapshot records no held regions")
        if sorted(r.name for r in plan.regions) != sorted(held):
            return Refusal(RefusalCode.REFILL_LAYOUT, "the refill plan's regions are not the "
                           "ones the hybrid image recorded")
        return Prepared(self.name, RefillWork(plan, image), canary=image.canary,
                        stages=image.stages)

    async def start(self, attempt: Attempt,  # type: ignore[override]
                    prepared: Prepared[RefillWork]) -> EngineProcess:
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
        return await super().start(attempt, image)

    def start_limit_s(self, prepared: Prepared[RefillWork]) -> float:  # type: ignore[override]
        return (load_timeout(prepared.plan.plan.bytes)
                + super().start_limit_s(prepared.plan.image))

    async def after_verified(self, engine: EngineProcess,  # type: ignore[override]
                             prepared: Prepared[RefillWork]) -> None:
        return None

    async def failed(self, prepared: Prepared[RefillWork],  # type: ignore[override]
                     reason: str) -> None:
        await super().failed(prepared.plan.image, reason)

    def _refill(self, digest: str, timeout: float):  # noqa: ANN202 - protocol.Refilled
        with HolderClient(self._link.path, timeout=timeout) as c:
            return c.refill(digest)

    def holder_answers(self) -> bool:
        """Whether a holder for this engine is configured and answers (blocking: a thread)."""
        return self._link.unavailable() is None

    def plan_from_files(self, digest: str) -> RefillPlan | None:
        """Leave the plan that loads `digest` from the model's files beside the holder, for a
        hybrid image this host did not make (one pulled from the fleet's store): its engine
        never committed the weights here, so no plan was left the usual way. Blocking."""
        plan = self._fresh_plan(digest)
        if plan is not None:
            log.info("refill plan for %s written from the model files (%d regions, %.1f MB)",
                     digest, len(plan.regions), plan.bytes / 1e6)
        return plan

    def _fresh_plan(self, digest: str) -> RefillPlan | None:
        try:
            plan = plan_for(self._model, self._digester(), digest)
            write_plan(self._link.path.parent, plan)
        except (ModelError, WeightsError, OSError) as e:
            log.warning("the refill plan could not be made again: %s", e)
            return None
        return plan

    def remember(self, digest: str) -> Path | None:
        """Leave a refill plan for `digest` in the holder's directory when the holder holds
        those weights; the path written, or None. Blocking: call it from a thread."""
        if not self.enabled or self._link.unavailable() is not None:
            return None
        try:
            with HolderClient(self._link.path) as c:
                held = c.committed_set(digest)
                backend = c.stats().backend
            if held is None:
                return None
            directory = self._link.path.parent
            names = sorted(r.name for r in held)
            plan = plan_for(self._model, self._digester(), digest)
            if names != sorted(r.name for r in plan.regions):
                # Held in another layout than the files' (vLLM's parameters): a refill of
                # the files would not give this engine's regions; a copy of them will.
                return self._remember_copy(digest, held, directory, backend)
            try:
                if load_plan(directory) == plan:
                    return None
            except ModelError as e:
                log.warning("replacing the refill plan: %s", e)
            path = write_plan(directory, plan)
        except (HolderError, ModelError, WeightsError, OSError) as e:
            log.warning("no refill plan written: %s", e)
            return None
        log.info("refill plan for %s written to %s (%d regions, %.1f MB)", digest, path,
                 len(plan.regions), plan.bytes / 1e6)
        return path

    def _remember_copy(self, digest: str, held: list[RegionInfo], directory: Path,
                       backend: str) -> Path | None:
        """A plan that loads a copy of the held set (written once per set: kept while it
        still names these regions and its copies are the files written)."""
        if backend in COPYABLE_BACKENDS:
            names = sorted(r.name for r in held)
            try:
                current = load_plan(directory)
            except ModelError as e:
                log.warning("replacing the refill plan: %s", e)
                current = None
            if (current is not None and current.source is PlanSource.COPY
                    and current.digest == digest
                    and sorted(r.name for r in current.regions) == names
                    and current.drift() is None):
                return None
        # From here on no plan names what is on disk: the old one (of the files' layout, or
        # of copies being replaced) goes first.
        (directory / PLAN_NAME).unlink(missing_ok=True)
        if backend not in COPYABLE_BACKENDS:
            log.info("no refill plan: the held regions of %s are not the files' layout, and "
                     "the %s backend's cannot be copied to disk yet", digest, backend)
            return None
        copies = directory / COPY_DIR
        held_bytes = sum(r.size for r in held)
        free = shutil.disk_usage(directory).free
        if free < held_bytes + COPY_HEADROOM:
            log.warning("no refill plan: a copy of the held weights (%.1f GB) does not fit "
                        "in %s (%.1f GB free)", held_bytes / 1e9, directory, free / 1e9)
            return None
        try:
            done = self._run([sys.executable, "-m", "agent.holder.heldcopy", "--socket",
                              str(self._link.path), "--digest", digest, "--out", str(copies)],
                             timeout_s=load_timeout(held_bytes))
            plan = RefillPlan.model_validate_json(done.stdout)
        except (CommandError, ValidationError) as e:
            log.warning("no refill plan: the held weights of %s could not be copied: %s",
                        digest, e)
            return None
        for old in copies.iterdir():
            if old.name not in {f.name for f in plan.files}:
                old.unlink(missing_ok=True)
        path = write_plan(directory, plan)
        log.info("refill plan for %s written to %s: a copy of the held regions (%d, %.1f MB) "
                 "in %s", digest, path, len(plan.regions), plan.bytes / 1e6, copies)
        return path


__all__ = ["HolderRefusedError", "RefillRestore", "RefillWork"]
