"""The checkpoint-backend interface that Pitstop's CRIU and vLLM's `vllm snapshot` implement."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.errors import SnapshotError
from agent.identity import Identity
from agent.store import Canary, Manifest, ProcessTree, Skipped, SnapshotKind, SnapshotStore

if TYPE_CHECKING:
    from agent.checkpoint.criu import DumpOptions
    from agent.checkpoint.xcomp import Grant


class BackendName(StrEnum):
    """Who makes and restores an image."""

    # Pitstop's own: CRIU of the engine tree, CUDA checkpoint of each process holding a GPU
    # (agent/checkpoint/snapshotter.py); snapshot kinds full and hybrid.
    CRIU = "criu"
    # vLLM's `vllm snapshot create|restore` (agent/engines/vllm/snapshot.py); kind vllm.
    VLLM = "vllm"


@dataclass(frozen=True)
class CreateRequest:
    """What to snapshot.

    Example::

        CreateRequest(kind="full", pid=engine.pid, canary=canary, leave_running=True)
    """

    kind: SnapshotKind
    # The running engine's root; None for a backend that starts an engine of its own to
    # snapshot (`vllm snapshot create` does).
    pid: int | None = None
    # The engine's answer to the canary just before; None when the backend records its own.
    canary: Canary | None = None
    # Keep the engine serving after the dump (else the backend may end it).
    leave_running: bool = False
    # A hybrid image's held regions (see Manifest.held).
    held: dict[str, dict[str, Any]] | None = None
    # A hybrid image's refill recipe (see Manifest.refill).
    refill: dict[str, Any] | None = None
    # CRIU backend only: the dump's flags; the default fits an engine the supervisor started.
    dump_options: DumpOptions | None = None


@dataclass(frozen=True)
class Image:
    """What a backend left in the staging directory: the manifest fields only it knows."""

    process: ProcessTree
    canary: Canary
    timings: dict[str, float]
    criu_flags: tuple[str, ...] = ()
    held: dict[str, dict[str, Any]] | None = None
    # Files it rewrites at every restore: the store neither seals nor verifies them.
    scratch: tuple[str, ...] = ()


@dataclass(frozen=True)
class SnapshotInfo:
    """A published snapshot, as `take` returns it."""

    id: str
    path: Path
    manifest: Manifest

    @property
    def image_bytes(self) -> int:
        return self.manifest.image_bytes


@dataclass
class RestoredProcess:
    """A restored engine tree, running, re-parented to the nearest subreaper (the agent).

    `outputs` maps the engine's fd (1, 2) to the read end of the new pipe wired to it;
    stdout and stderr share one reader when they shared one pipe at dump time (empty when
    the backend keeps the engine's output itself: vLLM writes it to the image's child.log).
    The caller owns the readers and reaps `pid`.
    """

    pid: int
    snapshot_id: str
    outputs: dict[int, io.FileIO]
    log_path: Path
    timings: dict[str, float] = field(default_factory=dict)
    # What re-asking for the AMX permission answered in each restored PID (empty when
    # the restore did not ask: no AMX on this CPU, or Regrant.OFF).
    amx: dict[int, Grant] = field(default_factory=dict)


class CheckpointBackend(Protocol):
    """Makes an image of an engine in a staging directory and restores an engine from one.

    The store around it does the rest, whatever the backend: it stages the directory,
    seals and publishes what `create` left there (`take`), checks checksums and the host
    identity before a restore (`SnapshotStore.select`), and quarantines and prunes.

    Example::

        info = take(store, backend, CreateRequest("full", pid=pid, canary=c), identity)
        sel = store.select(identity, kind="full", accept=lambda m: backend.inspect(
            m, store.path(m.id)))
        restored = backend.restore(sel.chosen, store.path(sel.chosen.id))

    Errors are SnapshotError (VllmSnapshotError, with its `code`, from vLLM's backend); a
    failed `create` leaves the engine as it was and the store publishes nothing.
    """

    name: BackendName
    # The snapshot kinds it makes and restores.
    kinds: frozenset[SnapshotKind]
    # Whether the image must be made under its final path (vLLM's records its own path in
    # the dumped tree): the store then stages it there (Draft.in_place).
    in_place: bool
    # Identity fields it puts right at restore instead of needing them equal (the CRIU
    # backend: gpu_uuid, through the CUDA driver's GPU pairs); the store compares the rest.
    remaps: frozenset[str]

    @property
    def create_limit_s(self) -> float:
        """The longest a `create` may take: past it, it is stuck (the supervisor keeps
        systemd's watchdog fed for that long, no longer)."""
        ...

    @property
    def restore_limit_s(self) -> float:
        """The longest a `restore` may take, likewise."""
        ...

    def create(self, request: CreateRequest, staging: Path) -> Image:
        """Write the image into `staging` (an empty private directory)."""
        ...

    def inspect(self, manifest: Manifest, image: Path) -> Skipped | None:
        """This backend's own reason to refuse a snapshot the store found sound and of this
        host (`corrupt` when it can never be used); None when it would restore it."""
        ...

    def restore(self, manifest: Manifest, image: Path, *,
                gpu_uuid: str | None = None) -> RestoredProcess:
        """Bring the engine back from `image`, onto the GPU `gpu_uuid` (the host's; None: the
        one it was taken on) when it `remaps` gpu_uuid; on failure nothing of it is left
        running."""
        ...


def take(store: SnapshotStore, backend: CheckpointBackend, request: CreateRequest,
         identity: Identity, *, clock: Callable[[], float] = time.monotonic) -> SnapshotInfo:
    """Have `backend` make an image in a draft of `store`, seal and publish it, then prune
    to the store's retention. Nothing is published when the backend or the seal fails, and
    no older snapshot is touched before the new one is. A write that fails (the store's
    file system full: CRIU's action script, the manifest) is a SnapshotError too."""
    if request.kind not in backend.kinds:
        raise ValueError(f"the {backend.name} backend makes no {request.kind} snapshots")
    try:
        return _take(store, backend, request, identity, clock)
    except OSError as e:
        of = f" of PID {request.pid}" if request.pid is not None else ""
        raise SnapshotError(f"the snapshot{of} could not be written: {e}; is the file system "
                            f"of {store.root} full?") from e


def _take(store: SnapshotStore, backend: CheckpointBackend, request: CreateRequest,
          identity: Identity, clock: Callable[[], float]) -> SnapshotInfo:
    created = datetime.now(UTC)
    with store.begin(request.kind, in_place=backend.in_place) as draft:
        image = backend.create(request, draft.dir)
        t0 = clock()
        files = draft.seal(image.scratch)
        manifest = Manifest(
            id=draft.id, kind=request.kind, created_at=created, identity=identity,
            process=image.process, files=files,
            timings={**image.timings, "seal": clock() - t0}, canary=image.canary,
            chunk_bytes=draft.chunk_bytes, criu_flags=image.criu_flags, held=image.held,
            refill=request.refill if image.held else None, scratch=image.scratch)
        path = draft.publish(manifest)
    r = store.retention
    if r is not None and r.keep is not None:
        # Only now, with the replacement published, may older good ones go.
        store.prune(r.keep, r.budget_bytes)
    return SnapshotInfo(manifest.id, path, manifest)
