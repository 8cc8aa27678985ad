"""Drop the all-zero pages of private anonymous memory from a CRIU image.

CRIU dumps every page a process has in memory, zeros included: memory written with zeros,
the untouched rest of a transparent huge page, and (after a CUDA checkpoint) the unused
parts of the device memory the driver copied into the process. A restore reads each one
back into memory that a fresh anonymous mapping already holds as zeros. Without them in
the image the restore reads less, and the memory comes back the same: CRIU maps a private
anonymous area fresh (zero-filled), or, for one inherited from the parent, drops what
the child's image does not hold (mem.c, restore_priv_vma_content). File-backed and shared
mappings are left alone: a page missing there would read the file's or the other
process's bytes, not zeros.

The image formats (criu/images/pagemap.proto, mm.proto, vma.proto): each image file
starts with two 32-bit magics, then entries, each a 32-bit length and a protobuf message.
pagemap-<pid>.img holds a pagemap_head (pages_id) and pagemap_entry messages in address
order; pages-<pages_id>.img holds the pages of the entries flagged PE_PRESENT, one after
another in that order (CRIU finds a page by summing the entries before it).
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agent.checkpoint.criu_image import (
    PAGE,
    PE_PRESENT,
    VMA_ANON_PRIVATE,
    VMA_AREA_HEAP,
    VMA_AREA_REGULAR,
    VMA_AREA_STACK,
    ImageDamagedError,
    ImageFormatError,
    fields,
    pagemap_entry,
    read_entries,
    vma_entries,
)

# Anything else set (vdso, vvar, AIO ring, SysV IPC, memfd, shadow stack, guard, plugin,
# unsupported, ...) means the area is not plain private anonymous memory.
_PLAIN = VMA_AREA_REGULAR | VMA_AREA_STACK | VMA_AREA_HEAP | VMA_ANON_PRIVATE
_CHUNK = 64 << 20
_ZERO = bytes(PAGE)


@dataclass(frozen=True)
class Dropped:
    """What `drop_zero_pages` did to one image directory."""

    pages: int    # pages in the pages-N.img files of processes, before
    dropped: int  # of them all zeros in private anonymous memory, now left out

    @property
    def bytes(self) -> int:
        return self.dropped * PAGE


def drop_zero_pages(image_dir: Path) -> Dropped:
    """Rewrite each process's pagemap and pages image in `image_dir` without the all-zero
    pages of its private anonymous areas. Each pair is replaced by rename, pages first (the
    store's seal makes them durable). ImageFormatError: a pair is not laid out as expected
    and was left as CRIU wrote it (pairs before it may be rewritten: the image is whole
    either way); ImageDamagedError: CRIU's image itself is broken, and OSError: it may be
    (a write failed); do not publish it either way."""
    total = dropped = 0
    for pagemap in sorted(image_dir.glob("pagemap-*.img")):
        pid = pagemap.name.removeprefix("pagemap-").removesuffix(".img")
        if not pid.isdigit():  # pagemap-shmem-*.img: shared memory, left alone
            continue
        mm = image_dir / f"mm-{pid}.img"
        if not mm.exists():
            continue
        n, d = _one(pagemap, mm, image_dir)
        total, dropped = total + n, dropped + d
    return Dropped(total, dropped)


def _one(pagemap: Path, mm: Path, image_dir: Path) -> tuple[int, int]:
    anon = _anon_private(mm)
    magic, entries = read_entries(pagemap)
    if not entries:
        raise ImageFormatError(f"{pagemap}: no pagemap_head")
    pages_id = fields(entries[0]).get(1)
    if pages_id is None:
        raise ImageFormatError(f"{pagemap}: its head names no pages image")
    pages = image_dir / f"pages-{pages_id}.img"
    tmp_pages = pages.with_name(pages.name + ".nozero")
    tmp_map = pagemap.with_name(pagemap.name + ".nozero")
    try:
        with pages.open("rb", buffering=0) as src, tmp_pages.open("wb") as dst:
            out_entries, total, dropped = _rewrite(src, dst, entries, anon, pages)
            if src.read(1):
                raise ImageDamagedError(f"{pages}: longer than its pagemap says")
        if not dropped:
            tmp_pages.unlink()
            return total, 0
        with tmp_map.open("wb") as m:
            m.write(magic)
            for raw in out_entries:
                m.write(struct.pack("<I", len(raw)) + raw)
        # Pages first: until the pagemap is replaced too, a restore would misread the pair,
        # but nothing restores a draft (the store publishes it after this returns).
        os.replace(tmp_pages, pages)
        os.replace(tmp_map, pagemap)
    finally:
        tmp_pages.unlink(missing_ok=True)
        tmp_map.unlink(missing_ok=True)
    return total, dropped


def _rewrite(src: BinaryIO, dst: BinaryIO, entries: list[bytes],
             anon: tuple[list[int], list[int]], pages: Path) -> tuple[list[bytes], int, int]:
    """Copy the pages of `src` to `dst` but the zero ones of private anonymous memory;
    (the pagemap's entries for what `dst` holds, pages before, pages dropped)."""
    out_entries = [entries[0]]
    total = dropped = 0
    for raw in entries[1:]:
        vaddr, nr, flags = pagemap_entry(raw)
        if not flags & PE_PRESENT:
            out_entries.append(raw)  # no pages of its own in the file
            continue
        total += nr
        kept = _Kept(dst, flags, out_entries)
        done = 0
        while done < nr:
            n = min(nr - done, _CHUNK // PAGE)
            data = _read_exact(src, n * PAGE, pages)
            drop = [i for i in _zero_indices(data, n, _ZERO)
                    if _inside(anon, vaddr + (done + i) * PAGE)]
            kept.split(memoryview(data), vaddr + done * PAGE, drop)
            done += n
        kept.end()
        dropped += kept.dropped
    return out_entries, total, dropped


class _Kept:
    """The kept pages of one pagemap entry: written to `dst`, each run of them between
    dropped pages a new entry of `flags` in `out`."""

    def __init__(self, dst: BinaryIO, flags: int, out: list[bytes]) -> None:
        self._dst, self._flags, self._out = dst, flags, out
        self._start = self._len = 0  # the run kept since the last dropped page
        self.dropped = 0

    def split(self, view: memoryview, vaddr: int, drop: list[int]) -> None:
        """Pages of `view` (at `vaddr`) kept, but those at the indices `drop`."""
        n = len(view) // PAGE
        prev = 0  # the first page of the chunk not yet written or dropped
        for i in [*drop, n]:
            if i > prev:  # pages prev..i-1 are kept; writes of a slice copy nothing
                self._dst.write(view[prev * PAGE:i * PAGE])
                if not self._len:
                    self._start = vaddr + prev * PAGE
                self._len += i - prev
            if i < n:
                self.dropped += 1
                self.end()
            prev = i + 1

    def end(self) -> None:
        """The run kept so far is one entry."""
        if self._len:
            self._out.append(_entry(self._start, self._len, self._flags))
            self._len = 0


def _zero_indices(data: bytes, n: int, zero: bytes) -> list[int]:
    """Which of the `n` pages in `data` are all zeros, in order (numpy when it is there,
    several times faster than comparing page by page)."""
    try:
        import numpy as np
    except ImportError:
        return [i for i in range(n) if data[i * PAGE:(i + 1) * PAGE] == zero]
    words = np.frombuffer(data, dtype=np.uint64, count=n * PAGE // 8).reshape(n, PAGE // 8)
    return np.flatnonzero(~words.any(axis=1)).tolist()


def _read_exact(src, n: int, path: Path) -> bytes:  # type: ignore[no-untyped-def]
    data = src.read(n)
    while len(data) < n:
        more = src.read(n - len(data))
        if not more:
            raise ImageDamagedError(f"{path}: shorter than its pagemap says")
        data += more
    return data


def _anon_private(mm: Path) -> tuple[list[int], list[int]]:
    """The (starts, ends) of the plain private anonymous areas in an mm image, sorted."""
    areas = []
    for v in vma_entries(mm):
        status = v.get(7, 0)
        if status & VMA_ANON_PRIVATE and status & VMA_AREA_REGULAR and not status & ~_PLAIN:
            areas.append((v[1], v[2]))
    areas.sort()
    return [a for a, _ in areas], [b for _, b in areas]


def _inside(areas: tuple[list[int], list[int]], addr: int) -> bool:
    starts, ends = areas
    i = bisect.bisect_right(starts, addr) - 1
    return i >= 0 and addr + PAGE <= ends[i]


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _entry(vaddr: int, nr_pages: int, flags: int) -> bytes:
    # As CRIU writes one: vaddr, compat_nr_pages 0, flags, nr_pages (page-xfer.c).
    return (b"\x08" + _put_varint(vaddr) + b"\x10\x00" + b"\x20" + _put_varint(flags)
            + b"\x28" + _put_varint(nr_pages))
