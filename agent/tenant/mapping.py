"""The tenant's mapping of held regions at fixed addresses: attach, detach, re-attach."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from agent.errors import HolderError, MappingError
from agent.holder.client import Grant, HolderClient
from agent.holder.protocol import MemoryKind, RegionInfo

PROT_NONE = 0
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED = mmap.MAP_SHARED
MAP_PRIVATE = mmap.MAP_PRIVATE
MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, what: str) -> int:
    # Python's mmap module cannot place a mapping at an address: libc it is.
    got = _libc.mmap(addr, length, prot, flags, fd, 0)
    if got in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise MappingError(f"{what}: mmap of {length} bytes failed: {os.strerror(err)}")
    if addr is not None and got != addr:
        raise MappingError(f"{what}: mmap placed {length} bytes at {got:#x}, not {addr:#x}")
    return int(got)


class Space(Protocol):
    """An address range reserved once; regions are mapped into it and out of it again."""

    base: int
    size: int
    align: int

    def map(self, offset: int, fds: list[int], chunks: list[int]) -> None:
        """Map the chunks' fds back to back at base + offset."""
        ...

    def unmap(self, offset: int, length: int) -> None:
        """Drop the mapping at base + offset but keep the range reserved."""
        ...

    def tensor(self, offset: int, length: int) -> Any:
        """A uint8 torch tensor over base + offset .. + length (no copy)."""
        ...

    def close(self) -> None:
        """Unmap everything and give the range back."""
        ...


class HostSpace:
    """Host address space for the cpu backend's memfds.

    A detached range is a PROT_NONE, MAP_NORESERVE anonymous mapping: CRIU dumps no pages
    of it, and nothing else the process maps can land there meanwhile.

    Example::

        space = HostSpace(1 << 20)
        space.map(0, grant.fds, grant.region.chunks)
        t = space.tensor(0, grant.region.size)
        space.unmap(0, 1 << 20)            # t must not be touched until mapped again
    """

    def __init__(self, size: int, align: int = mmap.PAGESIZE) -> None:
        if align % mmap.PAGESIZE:
            raise MappingError(f"alignment {align} is not a multiple of the page size")
        self.align = align
        self.size = -(-size // self.align) * self.align
        self.base = _mmap(None, self.size, PROT_NONE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, "reserve")

    def map(self, offset: int, fds: list[int], chunks: list[int]) -> None:
        at = self.base + offset
        for fd, length in zip(fds, chunks, strict=True):
            self._check(at - self.base, length)
            # MAP_FIXED replaces the reservation in one step: no window in which the
            # range is free for another mapping to take.
            _mmap(at, length, PROT_READ_WRITE, MAP_SHARED | MAP_FIXED, fd, "attach")
            at += length

    def unmap(self, offset: int, length: int) -> None:
        self._check(offset, length)
        _mmap(self.base + offset, length, PROT_NONE,
              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, "detach")

    def tensor(self, offset: int, length: int) -> Any:
        import torch

        self._check(offset, length)
        buf = (ctypes.c_uint8 * length).from_address(self.base + offset)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def close(self) -> None:
        if self.size and _libc.munmap(self.base, self.size) != 0:
            raise MappingError(f"munmap of {self.size} bytes at {self.base:#x} failed: "
                               f"{os.strerror(ctypes.get_errno())}")
        self.size = 0

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size or offset % self.align:
            raise MappingError(f"{length} bytes at offset {offset} do not fit the reserved "
                               f"{self.size} bytes at {self.base:#x}")


@dataclass(frozen=True)
class Placement:
    """Where one region sits in the space, and which version of it was mapped."""

    region: RegionInfo
    offset: int


def layout(regions: Iterable[RegionInfo], align: int) -> tuple[list[Placement], int]:
    """Regions back to back, each starting on `align`; returns placements and total size."""
    out, at = [], 0
    for r in regions:
        at = -(-at // align) * align
        out.append(Placement(r, at))
        at += r.mapped_size
    return out, -(-at // align) * align


class HeldSet:
    """The regions of one weight digest, mapped at fixed addresses in this process.

    The writer's path: `HeldSet.create(...)`, fill `tensor(name)`, `commit()`.
    A reader's path: `HeldSet.attach(...)`. Both then `detach()` before a checkpoint
    and `reattach()` after a restore: the same regions come back at the same addresses,
    so tensors (and CUDA graphs) made before the detach see the same bytes.

    Example::

        with HolderClient(sock) as h:
            held = HeldSet.attach(h, digest, HostSpace)
        weights = held.tensor(f"{digest}/model.safetensors")
        held.detach()                          # before the checkpoint
        with HolderClient(sock) as h:
            held.reattach(h)                   # after the restore
    """

    def __init__(self, placements: list[Placement], space: Space, by_digest: bool = False
                 ) -> None:
        self.placements = {pl.region.name: pl for pl in placements}
        self.space = space
        self.attached = False
        # Content-addressed regions (weights): `reattach` takes any version of the same
        # digest and chunks, e.g. one the holder refilled after it restarted.
        self.by_digest = by_digest
        self._writer: HolderClient | None = None

    @classmethod
    def attach(cls, client: HolderClient, digest: str,
               make_space: Callable[[int, int], Space], by_digest: bool = False) -> HeldSet:
        """Map every committed region of `digest`; raises HolderError when the set is not held."""
        regions = client.committed_set(digest)
        if regions is None:
            raise HolderError(f"the holder at {client.path} has no complete committed set "
                              f"for digest {digest}")
        align = max(r.align for r in regions)
        placements, total = layout(regions, align)
        held = cls(placements, make_space(total, align), by_digest=by_digest)
        try:
            held._map_all(client, expect=None)
        except BaseException:
            held.close()
            raise
        return held

    @classmethod
    def create(cls, client: HolderClient, digest: str, sizes: dict[str, int],
               make_space: Callable[[int, int], Space],
               memory: MemoryKind = MemoryKind.DEVICE, lease_s: float | None = None,
               by_digest: bool = False) -> HeldSet:
        """New regions of `digest` (name -> size), mapped for filling; `commit()` publishes.

        The client's session must stay open until `commit()`: if this process dies
        first, the holder frees the regions and nobody ever sees them half-written.
        """
        grants: list[Grant] = []
        try:
            for name, size in sorted(sizes.items()):
                grants.append(client.create(name, size, digest, parts=len(sizes),
                                            memory=memory, lease_s=lease_s))
            align = max(g.region.align for g in grants)
            placements, total = layout([g.region for g in grants], align)
            held = cls(placements, make_space(total, align), by_digest=by_digest)
            try:
                for g, pl in zip(grants, placements, strict=True):
                    held.space.map(pl.offset, g.fds, g.region.chunks)
            except BaseException:
                held.space.close()
                raise
        finally:
            for g in grants:
                g.close()
        held.attached = True
        held._writer = client
        return held

    def commit(self) -> None:
        if self._writer is None:
            raise MappingError("commit() is for a set made by HeldSet.create")
        committed = {name: self._writer.commit(name) for name in self.placements}
        self.placements = {n: Placement(committed[n], pl.offset)
                           for n, pl in self.placements.items()}
        self._writer = None

    def tensor(self, name: str) -> Any:
        """A uint8 tensor over the region's `size` bytes, valid while attached."""
        pl = self.placements[name]
        return self.space.tensor(pl.offset, pl.region.size)

    @property
    def identity(self) -> dict[str, dict[str, object]]:
        """What was mapped: for a hybrid image's manifest, to check the holder against."""
        return {n: {"holder_id": pl.region.holder_id, "epoch": pl.region.epoch,
                    "digest": pl.region.digest, "chunks": pl.region.chunks}
                for n, pl in sorted(self.placements.items())}

    def detach(self) -> None:
        """Unmap every region, keep the reserved range; tensors must not be touched now."""
        if self._writer is not None:
            raise MappingError("commit the set before detaching it")
        if not self.attached:
            return
        for pl in self.placements.values():
            self.space.unmap(pl.offset, pl.region.mapped_size)
        self.attached = False

    def reattach(self, client: HolderClient) -> None:
        """Map the same versions of the regions at the same addresses again.

        Refuses (MappingError) when the holder now has other bytes under a name: another
        holder (a restart lost the memory), another epoch (the region was replaced), or
        another digest. The caller then falls back to a full restore or a start. A set
        made `by_digest` (weights, whose bytes the digest fixes) takes another holder or
        epoch of the same digest, size and chunks: the holder loaded the same files again.
        """
        if self.attached:
            return
        self._map_all(client, expect=self.placements)

    def _map_all(self, client: HolderClient, expect: dict[str, Placement] | None) -> None:
        mapped: list[Placement] = []
        try:
            for name, pl in self.placements.items():
                with client.attach(name) as g:
                    if expect is not None:
                        _same_version(expect[name].region, g.region, self.by_digest)
                    self.space.map(pl.offset, g.fds, g.region.chunks)
                    mapped.append(Placement(g.region, pl.offset))
        except BaseException:
            for pl in mapped:
                self.space.unmap(pl.offset, pl.region.mapped_size)
            raise
        # What is mapped now: a refilled region's holder and epoch, for the next image.
        self.placements.update({pl.region.name: pl for pl in mapped})
        self.attached = True

    def close(self) -> None:
        self.space.close()
        self.attached = False


def _same_version(was: RegionInfo, now: RegionInfo, by_digest: bool = False) -> None:
    fields = ("digest", "size", "chunks") if by_digest else ("holder_id", "epoch", "digest",
                                                             "chunks")
    diffs = [f"{k} {getattr(was, k)!r} -> {getattr(now, k)!r}"
             for k in fields if getattr(was, k) != getattr(now, k)]
    if diffs:
        raise MappingError(f"region {was.name!r} is not the one this process had mapped "
                           f"({'; '.join(diffs)}); its memory cannot be re-attached")
