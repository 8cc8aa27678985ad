"""A copy on disk of a committed weights set that an engine holds in its own layout.

vLLM holds its parameters, not the files' bytes: a refill from the model's files cannot
make its regions. Once such a set is committed, this writes each region's bytes into a
file of the holder's directory and returns the refill plan that loads them again (source
`copy`): the holder's refill reads it as it reads model files, with the same checks.

Run as its own process (`python -m agent.holder.heldcopy`), a tenant of the holder that
attaches the set (the regions cannot go while it holds them) and never touches a GPU the
agent's process would then hold a context on. A cpu backend's region is a memfd, read like
a file; a cuda backend's is imported into this process's address space as an engine maps
it and copied to host memory piece by piece (cuMemcpyDtoH into one pinned buffer).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from agent.errors import HolderError, ModelError
from agent.holder.client import HolderClient
from agent.holder.protocol import MemoryKind, RegionInfo
from agent.holder.weightplan import PlanFile, PlanRegion, PlanSource, RefillPlan
from agent.weights import stat_key

# Where the copies live, under the holder's per-GPU directory (beside its plan).
COPY_DIR = "copies"
# The backends whose regions this can read back.
COPYABLE_BACKENDS = frozenset({"cpu", "cuda"})
PIECE = 16 << 20


class RegionReader(Protocol):
    """Reads one held region's bytes, given the fds of its grant."""

    def pieces(self, region: RegionInfo, fds: list[int]) -> Iterator[memoryview]:
        """The region's `size` bytes in order; each piece valid until the next."""
        ...


class MemfdReader:
    """The cpu backend's regions: memfds, read like files."""

    def pieces(self, region: RegionInfo, fds: list[int]) -> Iterator[memoryview]:
        left = region.size
        for fd, chunk in zip(fds, region.chunks, strict=True):
            at = 0
            while left and at < chunk:
                data = os.pread(fd, min(PIECE, chunk - at, left), at)
                if not data:
                    raise HolderError(f"a held chunk ended {at} bytes in, not {chunk}")
                yield memoryview(data)
                at += len(data)
                left -= len(data)
        if left:
            raise HolderError(f"the held chunks hold {region.size - left} bytes, not "
                              f"{region.size}")


class CudaReader:
    """The cuda backend's regions: the fds imported into a reserved VA range (CudaSpace, as
    an engine maps them), each piece copied device to host into one pinned buffer.

    `driver` is cuda-bindings' driver module (the default), or a fake of it in tests."""

    def __init__(self, driver: Any = None) -> None:
        if driver is None:
            from cuda.bindings import driver
        self._cu = driver
        self._device: int | None = None

    def _device_of(self, fd: int) -> int:
        """The device the allocation behind `fd` lives on, as this process numbers it."""
        from agent.tenant.mapping_cuda import checked

        cu = self._cu
        checked(cu.cuInit(0), "cuInit")
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        h = checked(cu.cuMemImportFromShareableHandle(fd, kind),
                    "cuMemImportFromShareableHandle")
        try:
            prop = checked(cu.cuMemGetAllocationPropertiesFromHandle(h),
                           "cuMemGetAllocationPropertiesFromHandle")
        finally:
            checked(cu.cuMemRelease(h), "cuMemRelease")
        return int(prop.location.id)

    def pieces(self, region: RegionInfo, fds: list[int]) -> Iterator[memoryview]:
        from agent.tenant.mapping_cuda import CudaSpace, checked

        cu = self._cu
        if self._device is None:
            self._device = self._device_of(fds[0])
        space = CudaSpace(region.mapped_size, align=region.align, device=self._device,
                          driver=cu)
        buf = None
        try:
            space.map(0, fds, region.chunks)
            # Pinned: a copy from device memory into pageable memory is staged by the
            # driver anyway, at a fraction of the speed.
            buf = checked(cu.cuMemHostAlloc(PIECE, 0), f"cuMemHostAlloc({PIECE})")
            at = 0
            while at < region.size:
                n = min(PIECE, region.size - at)
                checked(cu.cuMemcpyDtoH(buf, space.base + at, n), "cuMemcpyDtoH")
                yield memoryview((ctypes.c_char * n).from_address(int(buf))).cast("B")
                at += n
        finally:
            if buf is not None:
                checked(cu.cuMemFreeHost(buf), "cuMemFreeHost")
            space.close()


def copy_file_name(region: str) -> str:
    """The file a region's copy is written to: its name, made one path component."""
    return region.replace("/", "--").replace(":", "-") + ".bin"


def reader_for(backend: str) -> RegionReader:
    """How the device regions of a holder with `backend` are read back."""
    if backend == "cpu":
        return MemfdReader()
    if backend == "cuda":
        return CudaReader()
    raise HolderError(f"the {backend} backend's regions cannot be copied to disk (only the "
                      f"{' and '.join(sorted(COPYABLE_BACKENDS))} backends')")


def copy_held(socket: Path, digest: str, directory: Path,
              device_reader: RegionReader | None = None) -> RefillPlan:
    """Write the committed set of `digest` into `directory` (made private if missing);
    the plan that loads it back. HolderError when the set is not all committed, or the
    backend's memory cannot be read here; OSError when the disk cannot take it. A copy is
    written to a temporary name, fsynced and renamed: a half-written one is never named.
    `device_reader` reads the device regions in place of the backend's own reader."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with HolderClient(socket) as c:
        backend = c.stats().backend
        regions = c.committed_set(digest)
        if regions is None:
            raise HolderError(f"the holder at {socket} holds no committed set of {digest}")
        host: RegionReader = MemfdReader()
        device = device_reader or (reader_for(backend) if any(
            r.memory is MemoryKind.DEVICE for r in regions) else host)
        files, planned = [], []
        for r in regions:
            name = copy_file_name(r.name)
            reader = device if r.memory is MemoryKind.DEVICE else host
            with c.attach(r.name) as grant:
                sha256 = _write(reader.pieces(grant.region, grant.fds), r.size,
                                directory / name)
            key = stat_key(os.stat(directory / name))
            files.append(PlanFile(name=name, size=r.size, sha256=sha256, key=key))
            planned.append(PlanRegion(name=r.name, file=name, offset=0, size=r.size))
    return RefillPlan(digest=digest, model=str(directory), files=files, regions=planned,
                      source=PlanSource.COPY)


def _write(pieces: Iterator[memoryview], size: int, path: Path) -> str:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    h = hashlib.sha256()
    fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    try:
        # closing(): a failed write still ends the reader's generator, which unmaps the
        # region and frees its pinned buffer.
        with os.fdopen(fd_out, "wb") as out, contextlib.closing(pieces):  # type: ignore[type-var]
            written = 0
            for piece in pieces:
                h.update(piece)
                out.write(piece)
                written += len(piece)
            if written != size:
                raise HolderError(f"read {written} bytes of a held region, not {size}")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.holder.heldcopy", description=__doc__)
    ap.add_argument("--socket", type=Path, required=True, help="the holder's socket")
    ap.add_argument("--digest", required=True, help="the weights digest of the committed set")
    ap.add_argument("--out", type=Path, required=True, help="the directory to write into")
    args = ap.parse_args(argv)
    try:
        plan = copy_held(args.socket, args.digest, args.out)
    except (HolderError, ModelError, OSError) as e:
        print(f"heldcopy: {e}", file=sys.stderr)
        return 1
    json.dump(plan.model_dump(mode="json"), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
