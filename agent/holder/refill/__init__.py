"""The holder's refill: what its parts share (the tuning, the sink interface, the failure)."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from agent.holder.backends import Allocation
from agent.holder.protocol import ErrorCode

PAGE = mmap.PAGESIZE


class Host(StrEnum):
    """Where a piece waits in host memory for its copy to the GPU (cuda)."""

    # cuMemHostAlloc'ed buffers: the driver's own pinned memory.
    PINNED = "pinned"
    # cuMemHostAlloc(CU_MEMHOSTALLOC_WRITECOMBINED): the CPU only writes these buffers and
    # the GPU only reads them, so writes need not go through (and evict) the CPU caches.
    WRITE_COMBINED = "wc"
    # Anonymous memory in 2 MiB pages (MADV_HUGEPAGE), pinned with cuMemHostRegister: the
    # kernel's copies into it miss the TLB once every 2 MiB instead of every 4 KiB.
    HUGE_PAGES = "huge"
    # No buffers: the files are mapped here and each piece's page-cache pages registered
    # (cuMemHostRegister, read-only) and copied from where they are; the CPU copies nothing.
    DIRECT = "direct"


@dataclass(frozen=True)
class Tuning:
    """How a refill reads and copies; `DEFAULT_TUNING` is what the holder uses.

    Example::

        Tuning(threads=16, piece=64 << 20, buffers=3, host=Host.HUGE_PAGES)
        replace(DEFAULT_TUNING, threads=4)     # `pitstop holder --refill-threads 4`
    """

    # Reads in flight: page cache and NVMe both want several to reach their rate. From
    # the page cache each read is a kernel memcpy, so a thread moves what one core copies.
    threads: int
    # Bytes of one read, and on cuda of one host-to-device copy and one host buffer.
    piece: int = 16 << 20
    # Host buffers per thread (cuda; registrations in flight when direct): a thread reads
    # into one while the copies of the others run; threads x buffers x piece bytes pinned.
    buffers: int = 2
    host: Host = Host.PINNED

    def __post_init__(self) -> None:
        if self.threads < 1 or self.piece < 1 or self.buffers < 1:
            raise ValueError(f"{self}: threads, piece and buffers must be positive")
        if self.piece % PAGE:
            raise ValueError(f"{self}: a piece is a whole number of {PAGE}-byte pages")


# The one place the refill's defaults live; bench/refill_bench.py sweeps every knob on a
# GPU in one run. One thread a core, up to 16: the reads from the page cache are copies.
DEFAULT_TUNING = Tuning(threads=min(16, os.cpu_count() or 1), piece=16 << 20, buffers=2,
                        host=Host.PINNED)


class RefillFailure(Exception):
    """A refill that cannot complete; `code` is what the waiting clients are told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Sink(Protocol):
    """Where a refill's bytes go: regions of one backend, written from worker threads."""

    timings: dict[str, float]

    def open(self, allocations: list[Allocation]) -> None:
        """Make `allocations` writable here; on the job's thread, before the first write."""
        ...

    def write(self, region: int, offset: int, fd: int, file_offset: int, length: int) -> None:
        """Read `length` bytes of `fd` at `file_offset` into region `region` at `offset`."""
        ...

    def put(self, region: int, offset: int, data: bytes) -> None:
        """Write `data` (made here: a cast tensor) into region `region` at `offset`."""
        ...

    def zero(self, region: int, offset: int, length: int) -> None:
        """Write `length` zero bytes into region `region` at `offset` (a recipe's gaps)."""
        ...

    def finish(self) -> None:
        """Wait until every write has landed (copies still in flight on cuda)."""
        ...

    def close(self) -> None:
        ...


def pread_into(fd: int, view: memoryview, file_offset: int) -> None:
    """Fill `view` from `fd` at `file_offset`; a file shorter than that is a RefillFailure."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], file_offset + done)
        if got == 0:
            raise RefillFailure(ErrorCode.REFILL_FAILED, f"the file ended {len(view) - done} "
                                f"bytes early at offset {file_offset + done}")
        done += got
