"""The holder's table of regions: create, commit, attach, release, with byte accounting."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.errors import HolderInvariantError
from agent.holder.backends import Allocation, Backend, BackendError, GpuFaultError
from agent.holder.protocol import ErrorCode, MemoryKind, RegionInfo

log = logging.getLogger("pitstop.holder")


class RequestRefused(Exception):
    """A client mistake: answered with `code`, and the session goes on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Region:
    name: str
    digest: str
    parts: int
    epoch: int
    allocation: Allocation
    # The session writing it; None once committed.
    writer: object | None
    size: int
    memory: MemoryKind = MemoryKind.DEVICE
    backend: Backend | None = None
    lease_s: float | None = None
    # The process that created or last attached a leased region: while it lives, the
    # lease does not run. `idle_since` is when it exited.
    claimant: int | None = None
    idle_since: float | None = None

    def expires_at(self) -> float | None:
        if self.lease_s is None or self.claimant is not None or self.idle_since is None:
            return None
        return self.idle_since + self.lease_s

    @property
    def committed(self) -> bool:
        return self.writer is None


@dataclass
class RegionTable:
    """Every region the holder owns, by name.

    A name has at most one committed region (what readers attach) and at most one
    pending one (being written; it replaces the committed one when its writer commits).

    Example::

        table = RegionTable(backend, holder_id="ab12")
        r = table.create(session, "w/model.safetensors", 4096, "sha256-...", parts=1)
        table.commit(session, "w/model.safetensors")
        table.attach("w/model.safetensors").allocation.fds
    """

    backend: Backend
    holder_id: str
    max_bytes: int | None = None
    committed: dict[str, Region] = field(default_factory=dict)
    pending: dict[str, Region] = field(default_factory=dict)
    # Epochs only grow within one holder's life, even across release and re-create,
    # so (holder_id, epoch) names one version of a region's bytes for good.
    epochs: dict[str, int] = field(default_factory=dict)
    bytes_committed: int = 0
    bytes_pending: int = 0
    clock: Callable[[], float] = time.monotonic
    # Processes holding claims, and how the table asks to hear of one's exit (`exited`).
    alive: set[int] = field(default_factory=set)
    watch: Callable[[int], None] = lambda pid: None
    # memfds for host regions when the backend's own memory is a GPU's.
    _host: Backend | None = None

    def info(self, r: Region) -> RegionInfo:
        b = r.backend or self.backend
        return RegionInfo(name=r.name, size=r.size, digest=r.digest, parts=r.parts,
                          epoch=r.epoch, holder_id=self.holder_id, committed=r.committed,
                          chunks=list(r.allocation.chunks), align=b.align, memory=r.memory,
                          lease_s=r.lease_s)

    def _backend_for(self, memory: MemoryKind) -> Backend:
        if memory is MemoryKind.DEVICE or self.backend.name == "cpu":
            return self.backend
        if self._host is None:
            from agent.holder.backends.cpu import CpuBackend

            self._host = CpuBackend(getattr(self.backend, "gpu", "cpu"))
        return self._host

    def create(self, session: object, name: str, size: int, digest: str, parts: int,
               memory: MemoryKind = MemoryKind.DEVICE, lease_s: float | None = None) -> Region:
        old = self.pending.get(name)
        if old is not None and old.writer is not session:
            raise RequestRefused(ErrorCode.BUSY, f"region {name!r} is being written by another "
                                 "session; wait for its commit or for that writer to exit")
        if old is not None:
            self._drop_pending(old)  # the same writer starting over
        held = self.bytes_committed + self.bytes_pending
        if self.max_bytes is not None and held + size > self.max_bytes:
            raise RequestRefused(ErrorCode.NO_MEMORY, f"region {name!r} of {size} bytes would "
                                 f"exceed --max-bytes {self.max_bytes} ({held} held); release "
                                 "regions first (pitstop holder release)")
        backend = self._backend_for(memory)
        try:
            alloc = backend.allocate(name, size)
        except GpuFaultError:
            raise  # not a client mistake: the server stops and all held memory goes
        except BackendError as e:
            raise RequestRefused(ErrorCode.NO_MEMORY, f"region {name!r}: {e}") from e
        epoch = self.epochs.get(name, 0) + 1
        self.epochs[name] = epoch
        r = Region(name=name, digest=digest, parts=parts, epoch=epoch, allocation=alloc,
                   writer=session, size=size, memory=memory, backend=backend, lease_s=lease_s)
        self._claim(r, session)
        self.pending[name] = r
        self.bytes_pending += alloc.size
        log.info("created %s (%d bytes, epoch %d) for writing", name, alloc.size, epoch)
        return r

    def commit(self, session: object, name: str) -> Region:
        r = self.pending.get(name)
        if r is None:
            raise RequestRefused(ErrorCode.NOT_FOUND, f"no region {name!r} is being written; "
                                 "create it first")
        if r.writer is not session:
            raise RequestRefused(ErrorCode.NOT_OWNER, f"region {name!r} is written by another "
                                 "session; only its writer commits it")
        del self.pending[name]
        self.bytes_pending -= r.allocation.size
        old = self.committed.pop(name, None)
        if old is not None:
            self._free(old)
            self.bytes_committed -= old.allocation.size
        r.writer = None
        self.committed[name] = r
        self.bytes_committed += r.allocation.size
        log.info("committed %s (epoch %d, digest %s)", name, r.epoch, r.digest)
        return r

    def attach(self, name: str, session: object | None = None) -> Region:
        r = self.committed.get(name)
        if r is not None:
            self._claim(r, session)
            return r
        if name in self.pending:
            raise RequestRefused(ErrorCode.NOT_COMMITTED, f"region {name!r} is still being "
                                 "written; attach after its writer commits")
        raise RequestRefused(ErrorCode.NOT_FOUND, f"no committed region {name!r}")

    def release(self, session: object, name: str) -> Region:
        """Free the committed region of `name`, or the caller's own pending one (an abort)."""
        r = self.committed.pop(name, None)
        if r is not None:
            self._free(r)
            self.bytes_committed -= r.allocation.size
            log.info("released %s (epoch %d)", name, r.epoch)
            return r
        p = self.pending.get(name)
        if p is not None and p.writer is session:
            self._drop_pending(p)
            return p
        if p is not None:
            raise RequestRefused(ErrorCode.NOT_OWNER, f"region {name!r} is being written by "
                                 "another session and has nothing committed to release")
        raise RequestRefused(ErrorCode.NOT_FOUND, f"no region {name!r}")

    def session_closed(self, session: object) -> list[str]:
        """A writer went away: whatever it had not committed is freed, never shown."""
        dropped = [r for r in self.pending.values() if r.writer is session]
        for r in dropped:
            self._drop_pending(r)
        return [r.name for r in dropped]

    def _claim(self, r: Region, session: object | None) -> None:
        pid = getattr(session, "pid", None)
        if r.lease_s is None or pid is None:
            return
        if r.claimant not in (None, pid) and r.claimant in self.alive:
            # A leased region is one process's at a time: two engines writing one KV
            # pool would corrupt each other's requests.
            raise RequestRefused(ErrorCode.BUSY, f"region {r.name!r} is claimed by pid "
                                 f"{r.claimant}, which is still running; attach it after "
                                 "that process exits")
        r.claimant, r.idle_since = pid, None
        if pid not in self.alive:
            self.alive.add(pid)
            self.watch(pid)

    def exited(self, pid: int) -> None:
        """A claiming process is gone: the leases of its regions start to run."""
        self.alive.discard(pid)
        now = self.clock()
        for r in (*self.committed.values(), *self.pending.values()):
            if r.claimant == pid:
                r.claimant, r.idle_since = None, now

    def next_expiry(self) -> float | None:
        """When the first lease runs out (the clock's time), or None."""
        times = [t for r in self.committed.values() if (t := r.expires_at()) is not None]
        return min(times, default=None)

    def expire(self) -> list[Region]:
        """Release every committed region whose lease ran out unclaimed."""
        now = self.clock()
        gone = [r for r in self.committed.values()
                if (t := r.expires_at()) is not None and t <= now]
        for r in gone:
            del self.committed[r.name]
            self._free(r)
            self.bytes_committed -= r.allocation.size
            log.info("released %s (epoch %d): unclaimed for its lease of %gs", r.name, r.epoch,
                     r.lease_s)
        return gone

    def drop_all(self) -> tuple[int, int]:
        """Free every region, committed and pending: (regions, bytes) freed."""
        regions = len(self.committed) + len(self.pending)
        return regions, self.free_all()

    def free_all(self) -> int:
        freed = 0
        for r in [*self.pending.values(), *self.committed.values()]:
            freed += r.allocation.size
            self._free(r)
        self.pending.clear()
        self.committed.clear()
        self.bytes_pending = self.bytes_committed = 0
        return freed

    def close(self) -> None:
        if self._host is not None:
            self._host.close()

    def _drop_pending(self, r: Region) -> None:
        del self.pending[r.name]
        self.bytes_pending -= r.allocation.size
        self._free(r)
        log.info("dropped uncommitted %s (epoch %d)", r.name, r.epoch)

    def _free(self, r: Region) -> None:
        try:
            (r.backend or self.backend).free(r.allocation)
        except BackendError as e:
            # Memory the holder cannot free is memory it can no longer account for.
            raise HolderInvariantError(f"freeing region {r.name!r} failed: {e}") from e

    def check(self, live_sessions: set[int]) -> None:
        """Recount everything; a mismatch means the holder's books are wrong: stop."""
        committed = sum(r.allocation.size for r in self.committed.values())
        pending = sum(r.allocation.size for r in self.pending.values())
        problems = []
        if committed != self.bytes_committed or pending != self.bytes_pending:
            problems.append(f"bytes counted {self.bytes_committed}/{self.bytes_pending}, "
                            f"recounted {committed}/{pending}")
        for name, r in self.committed.items():
            if r.writer is not None or r.name != name or not r.allocation.fds:
                problems.append(f"committed region {name!r} is inconsistent")
        for name, r in self.pending.items():
            if r.writer is None or id(r.writer) not in live_sessions or not r.allocation.fds:
                problems.append(f"pending region {name!r} has no live writer")
        if problems:
            raise HolderInvariantError("holder bookkeeping broken: " + "; ".join(problems))
