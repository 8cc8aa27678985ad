"""The refill plan the agent leaves in a holder's directory: of the model's files, or of a copy."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent import commands
from agent.errors import CommandError, HolderError, ModelError, WeightsError
from agent.holder.client import HolderClient
from agent.holder.heldcopy import COPY_DIR, COPYABLE_BACKENDS
from agent.holder.protocol import RegionInfo
from agent.holder.weightplan import (
    PLAN_NAME,
    DriftCode,
    PlanRegion,
    PlanSource,
    RefillPlan,
    load_plan,
    plan_for,
    write_plan,
)
from agent.refusal import Refusal, RefusalCode
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


def recipe_limit_s(nbytes: int) -> float:
    """How long making the refill recipe of `nbytes` held may take (it reads the held set
    and the files once each, and hashes both); its process is stopped then."""
    return load_timeout(3 * nbytes)


class RefillPlans:
    """Writes and checks the refill plan in a holder's directory (`refill.json`), so that a
    holder that restarts empty (or after a reboot) loads the weights by itself.

    A plan of the model's files when the held regions are the files' layout (the reference
    engine); otherwise (vLLM holds its parameters) a recipe of the files that rebuilds the
    held bytes (`python -m agent.holder.recipe`), which hybrid images carry to other nodes;
    and when none verifies, a copy of the held set, written once by
    `python -m agent.holder.heldcopy` beside the plan, and a plan of that copy.

    Example::

        plans = RefillPlans(config.engine.model, digester=reader.digester)
        plans.remember(holder_socket, digest)    # blocking: call it from a thread
        plans.usable(holder_socket.parent, digest)   # the plan to refill from, or a Refusal
    """

    def __init__(self, model: Path, digester: WeightsDigester,
                 run: commands.Runner = commands.run) -> None:
        self._model = model
        self._digester = digester
        self._run = run

    def usable(self, directory: Path, digest: str) -> RefillPlan | Refusal:
        """The plan in `directory` when it loads the weights `digest` names as they are on
        disk now; else why not. Blocking (it may hash files)."""
        try:
            plan = load_plan(directory)
        except ModelError as e:
            return Refusal(RefusalCode.NO_REFILL_PLAN, str(e))
        if plan is None:
            return Refusal(RefusalCode.NO_REFILL_PLAN,
                           f"no refill plan in {directory} (the agent writes one "
                           "once an engine committed its weights)")
        # The digest the agent took for this start (as every start does: files whose stat
        # changed are hashed again) against the one the plan's files made.
        if plan.digest != digest:
            drift = plan.drift()
            return Refusal(RefusalCode.WEIGHTS_CHANGED,
                           f"the weights on disk ({digest}) are not the ones the refill plan "
                           f"names ({plan.digest})" + (f": {drift}" if drift else ""))
        drift = plan.drift()
        if drift is not None and drift.code is DriftCode.CHANGED \
                and plan.source is not PlanSource.COPY:
            # Same digest, other stat (a file touched or copied back): the bytes are the
            # plan's; a fresh plan records the keys they have now.
            fresh = self.from_files(directory, digest) if plan.source is PlanSource.FILES \
                else self._rebased(directory, plan.regions, digest)
            plan = fresh if isinstance(fresh, RefillPlan) else plan
            drift = plan.drift()
        if drift is not None:
            return Refusal(RefusalCode.WEIGHTS_CHANGED, f"the weights changed on disk since "
                           f"the refill plan was made: {drift}")
        return plan

    def from_files(self, directory: Path, digest: str) -> RefillPlan | None:
        """Write into `directory` the plan that loads `digest` from the model's files as
        they are now; None when it cannot be made (logged). Blocking (it may hash files)."""
        try:
            plan = plan_for(self._model, self._digester, digest)
            write_plan(directory, plan)
        except (ModelError, WeightsError, OSError) as e:
            log.warning("the refill plan could not be made again: %s", e)
            return None
        log.info("refill plan for %s written from the model files (%d regions, %.1f MB)",
                 digest, len(plan.regions), plan.bytes / 1e6)
        return plan

    def remember(self, socket: Path, digest: str) -> Path | None:
        """Leave a refill plan for `digest` beside the holder at `socket` when it holds
        those weights; the path written, or None. Blocking: call it from a thread."""
        directory = socket.parent
        try:
            with HolderClient(socket) as c:
                held = c.committed_set(digest)
                backend = c.stats().backend
            if held is None:
                return None
            names = sorted(r.name for r in held)
            plan = plan_for(self._model, self._digester, digest)
            if names != sorted(r.name for r in plan.regions):
                # Held in another layout than the files' (vLLM's parameters): a refill of
                # the files' sections would not give this engine's regions; a recipe of
                # the files' tensors may, else a copy of the held set will.
                return self._remember_recipe(socket, plan, held, backend)
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

    def _remember_recipe(self, socket: Path, files: RefillPlan, held: list[RegionInfo],
                         backend: str) -> Path | None:
        """A plan that rebuilds the held set from the model files (kept while it still
        names these regions and the files are unchanged); else a copy of the set."""
        directory, digest = socket.parent, files.digest
        if self._kept(digest, held, directory, PlanSource.RECIPE):
            return None
        plan = self._recipe(socket, files, sum(r.size for r in held))
        if isinstance(plan, Refusal):
            log.warning("no refill recipe for %s (%s): %s; the held set is copied instead",
                        digest, plan.code, plan.detail)
            return self._remember_copy(socket, digest, held, backend)
        path = write_plan(directory, plan)
        log.info("refill plan for %s written to %s: a recipe of the model files (%d regions, "
                 "%d parts, %.1f MB)", digest, path, len(plan.regions),
                 sum(len(r.parts or ()) for r in plan.regions), plan.bytes / 1e6)
        return path

    def _recipe(self, socket: Path, files: RefillPlan, held_bytes: int) -> RefillPlan | Refusal:
        """The held set's recipe, made and checked by its own process (a tenant of the
        holder that reads the set and the files once each, and hashes both)."""
        try:
            done = self._run([sys.executable, "-m", "agent.holder.recipe", "--socket",
                              str(socket), "--digest", files.digest, "--model", str(self._model)],
                             timeout_s=recipe_limit_s(held_bytes), check=False)
        except CommandError as e:
            return Refusal(RefusalCode.NO_REFILL_RECIPE, f"the recipe was not made: {e}")
        try:
            out: dict[str, Any] = json.loads(done.stdout) if done.ok else {}
            regions = [PlanRegion.model_validate(r) for r in out.get("regions", [])]
        except (ValueError, ValidationError) as e:
            return Refusal(RefusalCode.NO_REFILL_RECIPE, f"the recipe maker answered {e}")
        if not regions:
            why = out.get("refused") or done.stderr.strip() or f"exit status {done.returncode}"
            return Refusal(RefusalCode.NO_REFILL_RECIPE, str(why))
        plan = RefillPlan(digest=files.digest, model=files.model, files=files.files,
                          regions=regions, source=PlanSource.RECIPE)
        drift = plan.drift()
        if drift is not None:
            return Refusal(RefusalCode.WEIGHTS_CHANGED, f"the model files changed while the "
                           f"recipe was made: {drift}")
        return plan

    def from_recipe(self, directory: Path, recipe: dict[str, Any] | None,
                    digest: str) -> RefillPlan | Refusal:
        """Write into `directory` the plan of a recipe another node made (a pulled hybrid
        image's), for the weights `digest` as they are in this node's model directory.
        Blocking (it may hash files)."""
        if recipe is None:
            return Refusal(RefusalCode.NO_REFILL_RECIPE, "the image carries no refill recipe "
                           "(the node that made it could not make one that rebuilds its held "
                           "weights; its log says why)")
        try:
            theirs = RefillPlan.model_validate(recipe)
        except ValidationError as e:
            return Refusal(RefusalCode.NO_REFILL_RECIPE, f"the image's refill recipe is not "
                           f"one this agent reads: {e.errors()[0]['msg']}")
        if theirs.source is not PlanSource.RECIPE or theirs.digest != digest:
            return Refusal(RefusalCode.WEIGHTS_CHANGED, f"the image's refill recipe is for "
                           f"weights {theirs.digest} ({theirs.source}), not {digest}")
        return self._rebased(directory, theirs.regions, digest)

    def _rebased(self, directory: Path, regions: list[PlanRegion],
                 digest: str) -> RefillPlan | Refusal:
        """The recipe `regions` over this node's model files as they are now (their digest
        must be `digest`: the same names, sizes and sha256 as the recipe was made of),
        written into `directory`."""
        try:
            files = plan_for(self._model, self._digester, digest)
            plan = RefillPlan(digest=digest, model=files.model, files=files.files,
                              regions=regions, source=PlanSource.RECIPE)
            drift = plan.drift()
            if drift is not None:
                return Refusal(RefusalCode.WEIGHTS_CHANGED, f"the refill recipe does not fit "
                               f"the model files here: {drift}")
            write_plan(directory, plan)
        except (ModelError, WeightsError, OSError) as e:
            return Refusal(RefusalCode.WEIGHTS_CHANGED, f"no refill plan of the recipe: {e}")
        log.info("refill plan for %s written from a recipe (%d regions, %.1f MB)", digest,
                 len(plan.regions), plan.bytes / 1e6)
        return plan

    @staticmethod
    def recipe(directory: Path, digest: str) -> dict[str, Any] | None:
        """The recipe plan in `directory` for `digest`, as a snapshot's manifest carries
        it; None when the plan there is none, or not a recipe."""
        try:
            plan = load_plan(directory)
        except ModelError as e:
            log.warning("no refill recipe for the snapshot: %s", e)
            return None
        if plan is None or plan.source is not PlanSource.RECIPE or plan.digest != digest:
            return None
        return plan.model_dump(mode="json", exclude_none=True)

    def _remember_copy(self, socket: Path, digest: str, held: list[RegionInfo],
                       backend: str) -> Path | None:
        """A plan that loads a copy of the held set (written once per set: kept while it
        still names these regions and its copies are the files written)."""
        directory = socket.parent
        if backend in COPYABLE_BACKENDS and self._kept(digest, held, directory,
                                                       PlanSource.COPY):
            return None
        # From here on no plan names what is on disk: the old one (of the files' layout, or
        # of copies being replaced) goes first.
        (directory / PLAN_NAME).unlink(missing_ok=True)
        if backend not in COPYABLE_BACKENDS:
            log.info("no refill plan: the held regions of %s are not the files' layout, and "
                     "the %s backend's cannot be copied to disk yet", digest, backend)
            return None
        held_bytes = sum(r.size for r in held)
        free = shutil.disk_usage(directory).free
        if free < held_bytes + COPY_HEADROOM:
            log.warning("no refill plan: a copy of the held weights (%.1f GB) does not fit "
                        "in %s (%.1f GB free)", held_bytes / 1e9, directory, free / 1e9)
            return None
        copies = directory / COPY_DIR
        plan = self._copy(socket, digest, copies, held_bytes)
        if plan is None:
            return None
        for old in copies.iterdir():
            if old.name not in {f.name for f in plan.files}:
                old.unlink(missing_ok=True)
        path = write_plan(directory, plan)
        log.info("refill plan for %s written to %s: a copy of the held regions (%d, %.1f MB) "
                 "in %s", digest, path, len(plan.regions), plan.bytes / 1e6, copies)
        return path

    @staticmethod
    def _kept(digest: str, held: list[RegionInfo], directory: Path, source: PlanSource) -> bool:
        """Whether the plan in `directory` already loads this held set soundly, from
        `source`."""
        try:
            current = load_plan(directory)
        except ModelError as e:
            log.warning("replacing the refill plan: %s", e)
            return False
        return (current is not None and current.source is source
                and current.digest == digest
                and sorted(r.name for r in current.regions) == sorted(r.name for r in held)
                and current.drift() is None)

    def _copy(self, socket: Path, digest: str, copies: Path,
              held_bytes: int) -> RefillPlan | None:
        """The held set copied into `copies` by its own process (a tenant of the holder);
        the plan that loads the copy, or None."""
        try:
            done = self._run([sys.executable, "-m", "agent.holder.heldcopy", "--socket",
                              str(socket), "--digest", digest, "--out", str(copies)],
                             timeout_s=load_timeout(held_bytes))
            return RefillPlan.model_validate_json(done.stdout)
        except (CommandError, ValidationError) as e:
            log.warning("no refill plan: the held weights of %s could not be copied: %s",
                        digest, e)
            return None
