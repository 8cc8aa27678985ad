"""The refill plan the agent leaves in a holder's directory: of the model's files, or of a copy."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

from pydantic import ValidationError

from agent import commands
from agent.errors import CommandError, HolderError, ModelError, WeightsError
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


class RefillPlans:
    """Writes and checks the refill plan in a holder's directory (`refill.json`), so that a
    holder that restarts empty (or after a reboot) loads the weights by itself.

    A plan of the model's files when the held regions are the files' layout (the reference
    engine); otherwise (vLLM holds its parameters) a copy of the held set, written once by
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
                and plan.source is PlanSource.FILES:
            # Same digest, other stat (a file touched or copied back): the bytes are the
            # plan's; a fresh plan records the keys they have now.
            plan = self.from_files(directory, digest) or plan
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
                # the files would not give this engine's regions; a copy of them will.
                return self._remember_copy(socket, digest, held, backend)
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

    def _remember_copy(self, socket: Path, digest: str, held: list[RegionInfo],
                       backend: str) -> Path | None:
        """A plan that loads a copy of the held set (written once per set: kept while it
        still names these regions and its copies are the files written)."""
        directory = socket.parent
        if backend in COPYABLE_BACKENDS and self._copy_kept(digest, held, directory):
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
    def _copy_kept(digest: str, held: list[RegionInfo], directory: Path) -> bool:
        """Whether the plan in `directory` already loads a sound copy of this held set."""
        try:
            current = load_plan(directory)
        except ModelError as e:
            log.warning("replacing the refill plan: %s", e)
            return False
        return (current is not None and current.source is PlanSource.COPY
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
