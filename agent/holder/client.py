"""The tenant's side of the holder protocol: connect, create/commit/attach/release, list."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from agent.errors import HolderRefusedError, HolderUnavailableError
from agent.holder import protocol as p


@dataclass
class Grant:
    """A region and its fds, now owned by the caller: map them, then `close()`."""

    region: p.RegionInfo
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.pop())

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HolderClient:
    """One session with the holder; a writer keeps it open until it commits.

    Example::

        with HolderClient.for_gpu(Path("/run/pitstop/holder"), "cpu") as h:
            if not h.has_committed(digest):
                with h.create(f"{digest}/model.safetensors", size, digest) as g:
                    ...                                   # map g.fds, fill
                h.commit(f"{digest}/model.safetensors")
            with h.attach(f"{digest}/model.safetensors") as g:
                ...                                       # map g.fds
    """

    def __init__(self, path: Path | str, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._sock: socket.socket | None = None

    @classmethod
    def for_gpu(cls, base: Path | str, gpu: str, timeout: float = 30.0) -> HolderClient:
        return cls(p.socket_path(str(base), gpu), timeout=timeout)

    def __enter__(self) -> HolderClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.settimeout(self.timeout)
        try:
            s.connect(str(self.path))
        except OSError as e:
            s.close()
            raise HolderUnavailableError(
                f"no holder answers at {self.path} ({e.strerror}); start it with "
                f"`pitstop holder --backend cpu|cuda --gpu UUID --dir {self.path.parent.parent}`"
                " (or its systemd unit)") from e
        self._sock = s
        return s

    def _call(self, req: p.AnyRequest) -> tuple[p.Reply, list[int]]:
        s = self._connect()
        try:
            p.send(s, req)
            data, fds = p.receive(s)
        except (OSError, p.ProtocolError) as e:
            self.close()
            raise HolderUnavailableError(f"the holder at {self.path} stopped answering "
                                         f"({e}); is it still running?") from e
        if not data:
            self.close()
            raise HolderUnavailableError(f"the holder at {self.path} closed the session "
                                         "(it stopped, or refused this process)")
        try:
            reply = p.parse_reply(data)
        except ValueError as e:
            # A holder of another Pitstop version (its unit restarted first in an upgrade):
            # the ladder falls through, the agent does not exit (seen in the soak).
            self.close()
            raise HolderUnavailableError(
                f"the holder at {self.path} answered what this agent cannot read ({e}"[:600]
                + "); are the holder and the agent the same Pitstop version? Restart both "
                "after an upgrade") from e
        if not reply.ok:
            for fd in fds:
                os.close(fd)
            assert reply.error is not None
            if reply.error.code == p.ErrorCode.FORBIDDEN:
                self.close()
            raise HolderRefusedError(f"holder at {self.path}: {reply.error.message}",
                                     code=reply.error.code)
        return reply, fds

    def _grant(self, req: p.CreateRequest | p.NameRequest) -> Grant:
        reply, fds = self._call(req)
        assert reply.region is not None
        g = Grant(region=reply.region, fds=fds)
        if len(fds) != len(reply.region.chunks):
            g.close()
            raise HolderRefusedError(f"holder at {self.path} sent {len(fds)} fds for "
                                     f"{len(reply.region.chunks)} chunks of {req.name!r}")
        return g

    def create(self, name: str, size: int, digest: str, parts: int = 1,
               memory: p.MemoryKind = p.MemoryKind.DEVICE,
               lease_s: float | None = None) -> Grant:
        """A new, uncommitted region; invisible to others until `commit`, freed if we die.
        With `lease_s`, the region is claimed by this process (and, once attached, by the
        last process that attached it) until it exits; then, unclaimed for `lease_s`
        seconds, the holder releases it."""
        return self._grant(p.CreateRequest(name=name, size=size, digest=digest, parts=parts,
                                           memory=memory, lease_s=lease_s))

    def commit(self, name: str) -> p.RegionInfo:
        reply, _ = self._call(p.NameRequest(op="commit", name=name))
        assert reply.region is not None
        return reply.region

    def attach(self, name: str) -> Grant:
        return self._grant(p.NameRequest(op="attach", name=name))

    def release(self, name: str) -> p.RegionInfo:
        reply, _ = self._call(p.NameRequest(op="release", name=name))
        assert reply.region is not None
        return reply.region

    def list(self, digest: str | None = None) -> list[p.RegionInfo]:
        """Every region (committed and being written), or only those of `digest`."""
        reply, _ = self._call(p.ListRequest(digest=digest))
        return list(reply.regions or [])

    def stats(self) -> p.Stats:
        reply, _ = self._call(p.StatsRequest())
        assert reply.stats is not None
        return reply.stats

    def drop(self, reason: p.DropReason, detail: str = "") -> p.Dropped:
        """Free every region of this holder at once (after a GPU fault, say)."""
        reply, _ = self._call(p.DropRequest(reason=reason, detail=detail[:1000]))
        assert reply.dropped is not None
        return reply.dropped

    def refill(self, digest: str) -> p.Refilled:
        """Make the holder load `digest` from its refill plan and commit it; returns when the
        weights are committed (HolderRefusedError with code no_plan, drift, refill_failed,
        busy otherwise). Give the client a timeout that fits the load."""
        reply, _ = self._call(p.RefillRequest(digest=digest))
        assert reply.refilled is not None
        return reply.refilled

    def committed_set(self, digest: str) -> list[p.RegionInfo] | None:
        """The committed regions of `digest` when all `parts` of them are there, else None."""
        regions = [r for r in self.list(digest) if r.committed]
        if not p.whole_set(regions):
            return None
        return sorted(regions, key=lambda r: r.name)

    def has_committed(self, digest: str) -> bool:
        """Whether the whole weight set of `digest` is held and committed."""
        return self.committed_set(digest) is not None


def holder_available(path: Path | str, timeout: float = 2.0) -> str | None:
    """None when a holder answers at `path`; otherwise why not (a rung's refusal detail)."""
    try:
        with HolderClient(path, timeout=timeout) as h:
            h.stats()
    except (HolderUnavailableError, HolderRefusedError) as e:
        return str(e)
    return None


def stale_reason(client: HolderClient, expected: dict[str, dict[str, object]]) -> str | None:
    """Why held memory no longer matches what an image was taken against, or None.

    `expected` is the `held.regions` an engine reported at prepare time (name -> holder_id,
    epoch, digest, chunks). A hybrid restore is worth trying only when every region is
    still committed in this very holder at the same epoch, or, for a weights region
    (content-addressed: its digest fixes its bytes), committed with the same digest and
    chunks, whoever loaded it: why not otherwise (a rung's refusal detail).
    """
    from agent.holder.weightplan import content_addressed

    try:
        now = {r.name: r for r in client.list() if r.committed}
    except (HolderUnavailableError, HolderRefusedError) as e:
        return f"holder unavailable: {e}"
    for name, want in sorted(expected.items()):
        r = now.get(name)
        if r is None:
            return f"held region {name} is gone (released, or the holder restarted)"
        got: dict[str, object] = {"digest": r.digest, "chunks": r.chunks}
        if not content_addressed(name, str(want.get("digest"))):
            got = {"holder_id": r.holder_id, "epoch": r.epoch, **got}
        diffs = [f"{k} {want.get(k)!r} -> {v!r}" for k, v in got.items() if want.get(k) != v]
        if diffs:
            return f"held region {name} changed since the image was taken: {'; '.join(diffs)}"
    return None
