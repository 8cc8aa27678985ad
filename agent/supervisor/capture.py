"""Taking a snapshot of the serving engine: quiet it, shrink it, dump it, serve again."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint.backend import CheckpointBackend, CreateRequest, SnapshotInfo, take
from agent.config import Config
from agent.engines.base import EngineAdapter
from agent.engines.probe import EngineProbe
from agent.errors import EngineError, OpenConnectionsError, SnapshotError
from agent.identity import Identity
from agent.metrics import Metrics
from agent.refusal import Refusal
from agent.store import SnapshotKind, SnapshotStore
from agent.supervisor.canary import CanaryRecord
from agent.supervisor.engine import EngineProcess
from agent.supervisor.gate import EngineGate

log = logging.getLogger("pitstop.capture")

class _DumpFailed(SnapshotError):
    """The checkpoint itself failed (not the quiet wait, not the engine's detach)."""


class ResumeFailed(EngineError):
    """After a snapshot the engine could not take back what it detached (its held
    weights, its KV pool): it cannot serve, and must be replaced.

    `published` is the snapshot the dump made, None when the dump failed too; then
    `dump_error` says why, and the message names both failures.
    """

    def __init__(self, pid: int, resume_error: EngineError, kind: SnapshotKind,
                 published: CaptureResult | None, dump_error: SnapshotError | None) -> None:
        self.resume_error = resume_error
        self.kind = kind
        self.published = published
        self.dump_error = dump_error
        said = f"engine {pid} did not resume after the snapshot: {resume_error}"
        if dump_error is not None:
            said = f"{said}; and the snapshot itself failed: {dump_error}"
        super().__init__(said)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# Known CRIU refusals, by a piece of their first error line, and what they mean to the user.
_HINTS = (
    # CRIU 4.1 asks a TCP socket for SO_PASSCRED, which Linux >= 6.16 answers EOPNOTSUPP:
    # "sockets: Can't get 1:16 opt: Operation not supported" (CRIU issue 2705, fixed in 4.2).
    # Pitstop refuses such a CRIU, so this is one named by snapshots.criu behind our back.
    ("sockets: Can't get 1:", "this CRIU is older than 4.2 and cannot dump TCP sockets on "
     "Linux >= 6.16 (CRIU issue 2705); install CRIU >= 4.2 with `make criu`"),
    # CRIU's default network lock runs iptables, which a dump without `--network-lock`
    # needs as soon as the tree holds a TCP connection.
    ("Iptables configuration failed", "CRIU's default network lock needs iptables, which "
     "is not installed"),
    # vLLM's API server opens one unless kernel.io_uring_disabled=2.
    ("anon_inode:[io_uring]", "the engine uses io_uring, which CRIU refuses; set "
     "sysctl kernel.io_uring_disabled=2 before the engine starts"),
)


def dump_failure(kind: str, e: BaseException) -> str:
    """One line for the status and the ladder: CRIU could not dump the engine, and why."""
    # CRIU stamps its log lines with seconds since it started: noise in a status line.
    line = re.sub(r"\(\d+\.\d+\) ", "", _first_line(e))
    hint = next((h for key, h in _HINTS if key in line), None)
    return f"CRIU could not dump the {kind} engine: {line}" + (f" ({hint})" if hint else "")


@dataclass(frozen=True)
class CaptureResult:
    """A published snapshot and what making it cost."""

    info: SnapshotInfo
    duration_s: float
    freed_bytes: int

    def summary(self) -> dict:
        """What `pitstop snapshot create` is answered about the published snapshot."""
        return {"id": self.info.id, "kind": self.info.manifest.kind,
                "bytes": self.info.image_bytes, "duration_s": round(self.duration_s, 3),
                "freed_bytes": self.freed_bytes}


class Capture:
    """Snapshots a ready engine without losing a request.

    New requests are held by the front (admission paused), the ones in flight finish and
    idle connections to the engine are closed (the gate's quiesce); the engine drops its KV
    pool (detach), CRIU dumps it and leaves it running, the engine rebuilds the pool
    (resume), and admission resumes. A failed dump publishes nothing and
    leaves the engine serving. A failed resume leaves an engine that cannot serve: the gate
    is closed before admission resumes, so that no request reaches it, and `take` raises
    ResumeFailed for the supervisor to replace it.

    Example::

        result = await capture.take(engine, canary_record)
    """

    def __init__(self, backend: CheckpointBackend, store: SnapshotStore, adapter: EngineAdapter,
                 socket: Path, gate: EngineGate, metrics: Metrics,
                 identity: Callable[[], Identity], quiet_timeout_s: float,
                 control_timeout_s: float = 60.0,
                 on_published: Callable[[SnapshotInfo], None] = lambda info: None,
                 refill_recipe: Callable[[], Awaitable[dict | None]] | None = None,
                 recipe_wait_s: Callable[[], float] = lambda: 0.0) -> None:
        self._backend = backend
        # Publishes into it, pruned to its retention after each publish.
        self._store = store
        self._adapter = adapter
        self._socket = socket
        self._gate = gate
        self._metrics = metrics
        self._identity = identity
        # snapshots.quiet_timeout_s: a reload sets it (`reconfigure`), the next capture uses it.
        self.quiet_timeout_s = quiet_timeout_s
        self._control_timeout = control_timeout_s
        # Told each snapshot once it is published (the remote store's push).
        self._on_published = on_published
        # The recipe a hybrid image carries, so that a node that never held the weights
        # refills them from its model files (the holder's refill plan, once it is written).
        self._refill_recipe = refill_recipe
        self._recipe_wait_s = recipe_wait_s
        # The kind the engine's last detach made this capture take: a snapshot refused
        # before its detach (requests still in flight) is counted under it.
        self.kind: SnapshotKind = "full"
        # Why the last attempt failed, one line; "" once one succeeds. The restore rungs give
        # it as their reason to skip, and `pitstop status` shows it (snapshot_error).
        self.failure = ""

    def refusal(self) -> Refusal | None:
        """Why this engine gets no snapshot at all (it runs several workers); no I/O."""
        return self._adapter.image_refusal()

    def last_failure(self) -> str:
        """Why the last attempt to take a snapshot failed; "" when the last one worked."""
        return self.failure

    def reconfigure(self, config: Config) -> None:
        """snapshots.quiet_timeout_s, as a reload left it: the next capture waits that long."""
        self.quiet_timeout_s = config.snapshots.quiet_timeout_s

    @property
    def limit_s(self) -> float:
        """The longest `take` may last before it is stuck: the wait for requests in flight,
        the engine's detach and resume, the backend's create (and the seal with it)."""
        return (self.quiet_timeout_s + 2 * self._adapter.control_limit_s
                + self._backend.create_limit_s
                + (self._recipe_wait_s() if self._refill_recipe is not None else 0.0))

    async def take(self, engine: EngineProcess, canary: CanaryRecord) -> CaptureResult:
        """A `hybrid` snapshot when the engine's weights live in the holder, else `full`.

        Raises SnapshotError when no snapshot was published and the engine serves on, and
        ResumeFailed when the engine cannot serve any more (whether or not one was)."""
        refused = self.refusal()
        if refused is not None:
            raise SnapshotError(f"no snapshot of engine {engine.pid}: {refused.detail}")
        t0 = time.monotonic()
        # Before admission pauses: it may wait for the recipe still being made.
        recipe = await self._refill_recipe() if self._refill_recipe is not None else None
        self._gate.pause_admission()
        try:
            # Quiet also closes the front's idle connections to the engine (CRIU cannot
            # dump half of a Unix connection); the snapshotter refuses any still open.
            log.info("snapshot of engine %d: waiting up to %gs for %d requests in flight "
                     "(snapshots.quiet_timeout_s)", engine.pid, self.quiet_timeout_s,
                     self._gate.inflight)
            if not await self._gate.quiesce(self.quiet_timeout_s):
                raise SnapshotError(
                    f"{self._gate.inflight} requests still in flight after "
                    f"{self.quiet_timeout_s:.0f}s (snapshots.quiet_timeout_s); try again later")
            result = await self._dump(engine, canary, t0, recipe)
        except ResumeFailed as e:
            # Before admission resumes: the requests it held wait for the next engine.
            self._gate.close(str(e))
            if e.published is not None:
                self._published(e.published)
            else:
                self._metrics.snapshots_created.labels(kind=e.kind, result="failure").inc()
            raise
        except (SnapshotError, EngineError) as e:
            self._metrics.snapshots_created.labels(kind=self.kind, result="failure").inc()
            if not isinstance(e, _DumpFailed):
                self.failure = f"the last snapshot attempt failed: {_first_line(e)}"
            raise SnapshotError(f"snapshot of engine {engine.pid} failed: {e}") from e
        finally:
            self._gate.resume_admission()
        self._published(result)
        return result

    def _published(self, result: CaptureResult) -> None:
        kind = result.info.manifest.kind
        self.failure = ""
        self._metrics.snapshots_created.labels(kind=kind, result="success").inc()
        self._metrics.snapshot_create_duration.labels(kind=kind).observe(result.duration_s)
        self._on_published(result.info)

    async def _dump(self, engine: EngineProcess, canary: CanaryRecord, t0: float,
                    recipe: dict | None) -> CaptureResult:
        freed = 0
        held = None
        # The control calls have a session each, closed before the dump: a connection of
        # ours to the engine must not be open while CRIU takes its tree.
        async with EngineProbe(self._socket, timeout=self._control_timeout) as probe:
            detached = await self._adapter.detach(probe)
        if detached is not None:
            freed = detached.freed_bytes
            # Weights the engine maps from the holder were detached: the image leaves them
            # out, and records what a restore must find held.
            held = detached.held
        kind: SnapshotKind = "hybrid" if held else "full"
        self.kind = kind
        dumped: CaptureResult | None = None
        failed: _DumpFailed | None = None
        try:
            # A recipe of other regions than the detached ones (another load since) is none.
            if held is None or recipe is None or sorted(
                    r.get("name") for r in recipe.get("regions", [])) != sorted(held):
                recipe = None
            dumped = await self._publish(engine, canary, kind, held, freed, t0, recipe)
        except _DumpFailed as e:
            failed = e
        finally:
            # Whatever the dump did, the engine must take back what it detached.
            if detached is not None and engine.alive:
                try:
                    async with EngineProbe(self._socket,
                                           timeout=self._control_timeout) as probe:
                        await self._adapter.resume(probe)
                except EngineError as e:
                    raise ResumeFailed(engine.pid, e, kind, dumped, failed) from e
        if failed is not None:
            raise failed
        assert dumped is not None
        return dumped

    async def _publish(self, engine: EngineProcess, canary: CanaryRecord, kind: SnapshotKind,
                       held: dict | None, freed: int, t0: float,
                       recipe: dict | None = None) -> CaptureResult:
        """Dump the detached engine and publish its image; _DumpFailed when that fails."""
        try:
            info = await asyncio.get_running_loop().run_in_executor(
                None, self._capture, engine.pid, canary, kind, held, recipe)
        except OpenConnectionsError as e:
            self.failure = f"the snapshot was refused before CRIU ran: {e}"
            raise _DumpFailed(str(e)) from e
        except SnapshotError as e:
            self.failure = dump_failure(self._adapter.kind, e)
            raise _DumpFailed(str(e)) from e
        duration = time.monotonic() - t0
        log.info("snapshot %s published: %.1f MB in %.2fs (%s); the engine freed %.1f MB "
                 "before the dump", info.id, info.image_bytes / 1e6, duration,
                 ", ".join(f"{k} {v:.2f}s" for k, v in info.manifest.timings.items()),
                 freed / 1e6)
        return CaptureResult(info=info, duration_s=duration, freed_bytes=freed)

    def _capture(self, pid: int, canary: CanaryRecord, kind: SnapshotKind,
                 held: dict | None, recipe: dict | None = None) -> SnapshotInfo:
        request = CreateRequest(kind=kind, pid=pid, leave_running=True,  # type: ignore[arg-type]
                                held=held, canary=canary.to_manifest(), refill=recipe)
        return take(self._store, self._backend, request, self._identity())
