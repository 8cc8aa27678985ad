"""The fleet's snapshot store, for the agent: pull before a cold start, push what it made."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.checkpoint.backend import SnapshotInfo
from agent.config import Config, S3Url, SnapshotsConfig
from agent.drift import compare
from agent.errors import MissingExtraError, RemoteError, SnapshotError
from agent.holder.plans import RefillPlans
from agent.identity import Identity
from agent.metrics import Metrics
from agent.refusal import Refusal, RefusalCode
from agent.store import SnapshotKind, SnapshotStore
from agent.store.remote import PORTABLE_KINDS, Transfer, pull, push
from agent.store.s3 import Bucket
from agent.supervisor.ladder import Attempt
from agent.supervisor.paths.holder import HolderLink
from agent.supervisor.status import AgentStatus

log = logging.getLogger("pitstop.remote")

# What a pull does besides moving bytes (listing, reading manifests, hashing the image,
# publishing it) may take this long past snapshots.pull_timeout_s before it is stuck.
SLACK_S = 120.0


class RemoteSnapshots:
    """Pulls a snapshot that fits this host from `snapshots.remote` when the local store has
    none (before the ladder is walked, so its restore rungs find it), and pushes each
    snapshot the agent publishes when `snapshots.publish` is on.

    With a holder that answers, a hybrid snapshot is preferred: the holder loads the weights
    from the model files (the refill rung, from a refill plan written here), then the small
    image is restored; without one, a full snapshot.

    Example::

        remote = RemoteSnapshots(settings=config.snapshots, store=store, ...)
        await remote.before_walk(attempt)   # in the supervisor, before the ladder
        remote.published(info)             # after a capture (snapshots.publish)
    """

    def __init__(self, *, settings: SnapshotsConfig, store: SnapshotStore,
                 identity: Callable[[], Identity], remaps: frozenset[str],
                 holder: HolderLink, plans: RefillPlans, metrics: Metrics,
                 status: AgentStatus, on_change: Callable[[], None],
                 bucket: Callable[[S3Url], Bucket] = Bucket) -> None:
        self._settings = settings
        self._store = store
        self._identity = identity
        self._remaps = remaps
        # The refill's two owners: the holder it would load, the plan it would load from.
        self._holder = holder
        self._plans = plans
        self._metrics = metrics
        self._status = status
        self._on_change = on_change
        self._bucket = bucket
        self._pushes: set[asyncio.Task] = set()

    def reconfigure(self, config: Config) -> None:
        """snapshots.remote, publish and pull_timeout_s, as a reload left them."""
        self._settings = config.snapshots

    @property
    def limit_s(self) -> float:
        """The longest a pull may keep the start waiting (the supervisor's heartbeat)."""
        return self._settings.pull_timeout_s + SLACK_S

    async def before_walk(self, attempt: Attempt) -> None:
        """Pull a snapshot for this start when the local store has none that fits; what was
        taken, or why not, goes to the status and pitstop_snapshot_transfers_total."""
        if self._settings.remote is None:
            return
        with attempt.stage("pull"):
            done = await asyncio.to_thread(self._pull)
        if done is not None:
            self._record(done)

    def _kinds(self) -> tuple[SnapshotKind, ...]:
        # A hybrid image needs the weights in a holder; the refill rung puts them there.
        if self._holder.config.refill and self._holder.unavailable() is None:
            return PORTABLE_KINDS
        return ("full",)

    def _pull(self) -> Transfer | None:
        settings = self._settings
        assert settings.remote is not None
        identity = self._identity()
        kinds = self._kinds()
        try:
            for e in self._store.entries():
                m = e.manifest
                if m is not None and m.kind in kinds and \
                        not compare(m.identity, identity, self._remaps):
                    return None  # a local one fits: the rungs restore it
            done = pull(self._store, self._bucket(S3Url.parse(settings.remote)), identity,
                        kinds=kinds, remapped=self._remaps, timeout_s=settings.pull_timeout_s)
        except RemoteError as e:
            log.warning("no snapshot pulled from %s (%s): %s", settings.remote,
                        e.refusal.code, e.refusal.detail)
            return Transfer("pull", e.refusal.code.value, "", e.refusal.detail, at=time.time())
        except (SnapshotError, MissingExtraError, OSError) as e:
            log.warning("no snapshot pulled from %s: %s", settings.remote, e)
            return Transfer("pull", RefusalCode.TRANSFER_FAILED.value, "", str(e),
                            at=time.time())
        if done.kind == "hybrid" and identity.weights_digest:
            self._plan_refill(done.snapshot, identity.weights_digest)
        return done

    def _plan_refill(self, snapshot_id: str, digest: str) -> None:
        """Leave the plan the holder loads the image's weights from (the refill rung): the
        image's engine never committed them here, so none was left the usual way. The
        image's recipe when it carries one (an engine that holds its own layout, vLLM),
        else the files' sections (the reference engine)."""
        directory = self._holder.path.parent
        try:
            recipe = self._store.load(snapshot_id).refill
        except SnapshotError as e:
            log.warning("no refill plan for snapshot %s: %s", snapshot_id, e)
            return
        if recipe is None:
            self._plans.from_files(directory, digest)
            return
        plan = self._plans.from_recipe(directory, recipe, digest)
        if isinstance(plan, Refusal):
            log.warning("no refill plan of snapshot %s's recipe (%s): %s", snapshot_id,
                        plan.code, plan.detail)

    def published(self, info: SnapshotInfo) -> None:
        """A capture published `info`: push it, off the event loop, with snapshots.publish."""
        settings = self._settings
        if not settings.publish or settings.remote is None:
            return
        task = asyncio.get_running_loop().create_task(self._push(settings.remote, info.id))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)

    async def _push(self, where: str, snapshot_id: str) -> None:
        try:
            done = await asyncio.to_thread(push, self._store, snapshot_id,
                                           self._bucket(S3Url.parse(where)))
        except RemoteError as e:
            log.error("snapshot %s not pushed to %s (%s): %s", snapshot_id, where,
                      e.refusal.code, e.refusal.detail)
            done = Transfer("push", e.refusal.code.value, snapshot_id, e.refusal.detail,
                            at=time.time())
        except (SnapshotError, MissingExtraError, OSError) as e:
            log.error("snapshot %s not pushed to %s: %s", snapshot_id, where, e)
            done = Transfer("push", RefusalCode.TRANSFER_FAILED.value, snapshot_id, str(e),
                            at=time.time())
        self._record(done)

    def _record(self, done: Transfer) -> None:
        self._metrics.snapshot_transfers.labels(direction=done.direction,
                                                result=done.result).inc()
        if done.direction == "pull":
            self._status.last_pull = done
        else:
            self._status.last_push = done
        self._on_change()
