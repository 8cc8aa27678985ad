"""Restore rungs: the snapshot chosen through the store, restored by its checkpoint backend."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable

from agent import proc
from agent.checkpoint.backend import CheckpointBackend
from agent.checkpoint.snapshotter import Snapshotter
from agent.config import Config
from agent.engines.base import EngineAdapter
from agent.engines.probe import EngineProbe
from agent.errors import EngineError, RestoreBlockedError, SnapshotError, StartPathError
from agent.identity import Identity
from agent.metrics import Metrics
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest, SnapshotKind, SnapshotStore
from agent.supervisor.canary import CanaryRecord
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt, Prepared

log = logging.getLogger("pitstop.restore")

# The restored engine may take this many health timeouts to answer its resume.
RESTORE_TIMEOUTS = 10


def resume_timeout_s(config: Config) -> float:
    """How long a restored engine may take to answer its resume (health.timeout_s x 10)."""
    return config.health.timeout_s * RESTORE_TIMEOUTS


class SnapshotRestore:
    """What every restore rung does the same way, whatever the checkpoint backend: choose
    the newest snapshot of its kind through the store (identity, checksums, the backend's
    own check), count each snapshot refused in pitstop_snapshots_rejected_total by its code
    (once, however many walks pass it over), and move a corrupt or failed snapshot to the
    store's one quarantine."""

    name: str
    kind: SnapshotKind
    # What a refusal calls this rung's snapshots ("no usable snapshot: ...").
    noun = "snapshot"

    def __init__(self, *, backend: CheckpointBackend | None, store: SnapshotStore | None,
                 unavailable: str, identity: Callable[[], Identity], metrics: Metrics,
                 capture_failure: Callable[[], str] = lambda: "") -> None:
        self._backend = backend
        self._store = store
        # Why the last attempt to take a snapshot failed ("" if none did): when there is no
        # snapshot, that is the reason worth telling (CRIU cannot dump this engine, say).
        self._capture_failure = capture_failure
        self._unavailable = unavailable
        self._identity = identity
        self._metrics = metrics
        # The refusal codes of the snapshots passed over when none was usable, for
        # `pitstop_snapshot_stale`; () once one is chosen.
        self.stale_reasons: tuple[RefusalCode, ...] = ()

    def choose(self) -> Prepared[Manifest] | Refusal:
        """The snapshot this rung would restore now, its checks run (the standby, which
        restores it ahead, asks); blocking: run it in a worker thread."""
        return self._choose()

    def host_gpu_uuid(self) -> str | None:
        """This host's GPU, as the identity the rung checks snapshots against reads it."""
        return self._identity().gpu_uuid

    def _choose(self) -> Prepared[Manifest] | Refusal:
        """The newest usable snapshot, or why there is none; blocking (hashes files): run it
        in a worker thread."""
        if self._backend is None or self._store is None:
            return Refusal(RefusalCode.SNAPSHOTS_UNAVAILABLE, self._unavailable)
        backend, store = self._backend, self._store
        t0 = time.monotonic()
        try:
            selection = store.select(self._identity(), kind=self.kind,
                                     accept=lambda m: backend.inspect(m, store.path(m.id)),
                                     remapped=backend.remaps)
        except SnapshotError as e:
            # The store's root itself is refused (a symlink, another owner): no rung of it.
            return Refusal(RefusalCode.SNAPSHOTS_UNAVAILABLE, f"snapshots unavailable: {e}")
        # Verifying every chunk of a multi-GB image is part of the restore's cost.
        select_s = time.monotonic() - t0
        # A snapshot of the other kind is the other rung's, not refused: counting it on
        # every walk would show a stale reason while that rung restores it fine.
        refused = [s for s in selection.skipped if s.refusal.code is not RefusalCode.WRONG_KIND]
        for s in refused:
            log.warning("snapshot %s refused (%s): %s", s.id, s.refusal.code, s.refusal.detail)
            self._metrics.rejected(s.id, s.refusal.code.value)
            if s.corrupt:
                self._quarantine(s.id, s.refusal.detail, s.refusal.code)
        m = selection.chosen
        if m is None:
            self.stale_reasons = tuple(sorted({s.refusal.code for s in refused}))
            if refused:
                said = "; ".join(f"{s.id}: {s.refusal.code}: {s.refusal.detail}"
                                 for s in refused)
                return Refusal(RefusalCode.NO_USABLE_SNAPSHOT, f"no usable {self.noun}: {said}")
            return Refusal(RefusalCode.NO_SNAPSHOT, self._none_yet())
        self.stale_reasons = ()
        return Prepared(self.name, m, canary=CanaryRecord.from_manifest("snapshot:" + m.id,
                                                                        m.canary),
                        stages={"select": select_s})

    def _none_yet(self) -> str:
        """Why there is no snapshot at all, in words for the operator."""
        failure = self._capture_failure()
        return f"no snapshot: {failure}" if failure else "no snapshot yet"

    async def failed(self, prepared: Prepared[Manifest], reason: str,
                     code: RefusalCode = RefusalCode.RESTORE_FAILED) -> None:
        if self._store is None:
            return
        # Off the loop: a rename and fsyncs on a disk a dump may be filling, then the
        # quarantine pruned to its retention, which can delete images of many GB.
        await asyncio.to_thread(self._quarantine, prepared.plan.id, reason, code)
        self._metrics.rejected(prepared.plan.id, code.value)

    def _quarantine(self, snapshot_id: str, reason: str, code: RefusalCode) -> None:
        assert self._store is not None
        try:
            where = self._store.quarantine(snapshot_id, reason, code)
            log.error("snapshot %s quarantined (%s): %s", snapshot_id, where, reason)
        except (OSError, SnapshotError) as e:
            log.error("snapshot %s failed (%s) and could not be quarantined: %s",
                      snapshot_id, reason, e)


class FullRestore(SnapshotRestore):
    """Restore the newest snapshot whose identity matches this host and whose files verify."""

    name = "full"
    reuses_held_memory = False
    kind = "full"

    def __init__(self, *, snapshotter: Snapshotter | None, unavailable: str,
                 adapter: EngineAdapter, socket: os.PathLike, identity: Callable[[], Identity],
                 metrics: Metrics, timeout_s: float,
                 capture_failure: Callable[[], str] = lambda: "") -> None:
        super().__init__(backend=snapshotter,
                         store=snapshotter.store if snapshotter is not None else None,
                         unavailable=unavailable, identity=identity, metrics=metrics,
                         capture_failure=capture_failure)
        self._adapter = adapter
        self._socket = socket
        # How long the restored engine may take to answer its resume (resume_timeout_s).
        self.timeout_s = timeout_s

    def reconfigure(self, config: Config) -> None:
        """health.timeout_s, as a reload left it: the next resume's limit."""
        self.timeout_s = resume_timeout_s(config)

    async def prepare(self, attempt: Attempt) -> Prepared[Manifest] | Refusal:
        # Reading the identity and verifying every chunk of a multi-GB image take seconds.
        return await asyncio.to_thread(self._choose)

    def image_refusal(self) -> Refusal | None:
        """Why this engine's images are neither restored nor taken (several workers)."""
        return self._adapter.image_refusal()

    def one_worker_refusal(self, rung: str) -> Refusal | None:
        """Why `rung` (refill, standby: engines of one worker) skips this engine."""
        return self._adapter.one_worker_refusal(rung)

    def _choose(self) -> Prepared[Manifest] | Refusal:
        refused = self.image_refusal()
        if refused is not None:
            return refused
        return super()._choose()

    def start_limit_s(self, prepared: Prepared[Manifest]) -> float:
        # The backend's restore, then the engine's resume.
        backend = self._backend.restore_limit_s if self._backend is not None else 0.0
        return backend + self._adapter.control_limit_s

    async def start(self, attempt: Attempt, prepared: Prepared[Manifest]) -> EngineProcess:
        assert self._backend is not None and self._store is not None
        manifest = prepared.plan
        # The dumped engine re-binds its socket path on restore; a leftover file blocks it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket)
        # The host's GPU (the engine identity of this start: no I/O): a snapshot taken on
        # another GPU of the same kind is restored onto this one.
        gpu = self._identity().gpu_uuid
        try:
            restored = await proc.in_parent_thread(
                functools.partial(self._backend.restore, gpu_uuid=gpu), manifest,
                self._store.path(manifest.id))
        except RestoreBlockedError as e:
            # The host's failure (a PID still taken), not the image's: it stays a candidate.
            raise StartPathError(Refusal(
                RefusalCode.PID_TAKEN,
                f"restore of snapshot {manifest.id} could not run: {e}")) from e
        except SnapshotError as e:
            await self.failed(prepared, str(e))
            raise StartPathError(Refusal(
                RefusalCode.RESTORE_FAILED,
                f"restore of snapshot {manifest.id} failed: {e}")) from e
        for stage, secs in restored.timings.items():
            attempt.stages[stage] = attempt.stages.get(stage, 0.0) + secs
        out = restored.outputs.get(1) or restored.outputs.get(2)
        fd = os.dup(out.fileno()) if out is not None else None
        for f in {id(f): f for f in restored.outputs.values()}.values():
            f.close()
        engine = EngineProcess.adopt(restored.pid, stdout=fd,
                                      health_path=self._adapter.health_path)
        log.info("restored snapshot %s as PID %d", manifest.id, restored.pid)
        # What prepare dropped before the dump (the KV pool; in a hybrid image the held
        # weights' mapping) comes back before the canary.
        with attempt.stage("resume"):
            try:
                async with EngineProbe(self._socket, timeout=self.timeout_s) as probe:
                    await self._adapter.resume(probe)
            except EngineError as e:
                await engine.kill()
                await engine.close()
                await self.failed(prepared, f"resume after restore failed: {e}")
                raise StartPathError(Refusal(
                    RefusalCode.RESUME_FAILED, f"restored engine did not resume: {e}")) from e
        return engine

    async def after_verified(self, engine: EngineProcess, prepared: Prepared[Manifest]) -> None:
        return None
