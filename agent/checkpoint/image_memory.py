"""What a CRIU image's memory is made of: the bytes each process's pages take, by the kind
of mapping they were dumped from (`pitstop snapshot memory`).

A restore reads every page the image holds back into memory, so its time follows these
bytes; this says which mappings they come from (the heap, anonymous memory such as a CUDA
checkpoint's copy of device memory, a file's private pages, shared memory), and how they
lie: in how many mappings, in how many runs of contiguous pages (each a read of its own),
over how many 2 MiB windows (with transparent huge pages, each one the mapping covers is a
huge page the restore faults in and clears whole, however few of its pages the image
holds). Two images of the same bytes can take different times to restore when these differ.

The images read (criu/images/mm.proto, vma.proto, pagemap.proto, fdinfo.proto): mm-<pid>.img
holds the vma_entry list (start 1, end 2, shmid 4: the file's id, status 7), pagemap-<pid>.img
the entries of the pages in pages-<n>.img (vaddr 1, nr_pages 5, flags 4), files.img each
file by id (id 2, reg 3: name 6), pagemap-shmem-<id>.img the pages of shared memory.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from agent.checkpoint.criu_image import (
    PAGE,
    PE_PRESENT,
    VMA_ANON_PRIVATE,
    VMA_ANON_SHARED,
    VMA_AREA_HEAP,
    VMA_AREA_MEMFD,
    VMA_AREA_STACK,
    VMA_FILE_PRIVATE,
    VMA_FILE_SHARED,
    fields_all,
    pagemap_entry,
    read_entries,
    vma_entries,
)

_REG_FILE = 1  # fd_types REG in criu/images/fdinfo.proto


# The window a transparent huge page covers on x86-64.
HUGE = 2 << 20


@dataclass(frozen=True)
class MemoryRow:
    """The bytes of one process's pages (pid None: shared memory) dumped from one kind of
    mapping: `heap`, `stack`, `anonymous`, `file <path>`, `memfd <name>`, `shared`, `other`;
    and how they lie: `areas`, the mappings (shared memory: the segments) holding any;
    `runs`, the runs of contiguous pages within one mapping; `windows_2m`, the 2 MiB-aligned
    windows holding any."""

    pid: int | None
    kind: str
    bytes: int
    areas: int
    runs: int
    windows_2m: int


@dataclass(frozen=True)
class _Vma:
    start: int
    end: int
    kind: str


@dataclass
class _Tally:
    """One row's pages as they are found, in address order within each mapping."""

    pages: int = 0
    areas: set[int] = field(default_factory=set)
    runs: int = 0
    windows: set[int] = field(default_factory=set)
    # (area, end address) of the run the last pages added went to.
    last: tuple[int, int] = (-1, -1)

    def add(self, area: int, at: int, pages: int) -> None:
        end = at + pages * PAGE
        self.pages += pages
        self.areas.add(area)
        if self.last != (area, at):
            self.runs += 1
        self.last = (area, end)
        self.windows.update(range(at // HUGE, (end - 1) // HUGE + 1))

    def row(self, pid: int | None, kind: str) -> MemoryRow:
        return MemoryRow(pid, kind, self.pages * PAGE, len(self.areas), self.runs,
                         len(self.windows))


def image_memory(image_dir: Path) -> list[MemoryRow]:
    """Every process's page bytes in `image_dir` by kind of mapping, largest first.

    Example::

        for row in image_memory(store.path(snapshot_id)):
            print(row.pid, row.kind, row.bytes)
    """
    names = _file_names(image_dir / "files.img")
    rows: defaultdict[tuple[int | None, str], _Tally] = defaultdict(_Tally)
    for n, pagemap in enumerate(sorted(image_dir.glob("pagemap-*.img"))):
        pid = pagemap.name.removeprefix("pagemap-").removesuffix(".img")
        if pid.startswith("shmem-"):
            # Each segment's pages by their offset in it: a segment is one area of its own.
            for vaddr, nr in _present(pagemap):
                rows[(None, "shared")].add(-1 - n, vaddr, nr)
            continue
        mm = image_dir / f"mm-{pid}.img"
        if not pid.isdigit() or not mm.exists():
            continue
        rows.update(_process_rows(int(pid), pagemap, _vmas(mm, names)))
    return sorted((t.row(pid, kind) for (pid, kind), t in rows.items()),
                  key=lambda r: (-r.bytes, r.pid or 0, r.kind))


def _process_rows(pid: int, pagemap: Path,
                  vmas: list[_Vma]) -> dict[tuple[int | None, str], _Tally]:
    """One process's rows: its pages in the image split by the mapping each falls in."""
    rows: defaultdict[tuple[int | None, str], _Tally] = defaultdict(_Tally)
    starts = [v.start for v in vmas]
    for vaddr, nr in _present(pagemap):
        for area, kind, at, n in _split(vmas, starts, vaddr, nr):
            rows[(pid, kind)].add(area, at, n)
    return rows


def images_in(snapshot_dir: Path) -> Path | None:
    """The directory of CRIU's images in a snapshot's directory (the top for Pitstop's, a
    subdirectory for vLLM's own artifact); None when it holds none."""
    if any(snapshot_dir.glob("pagemap-*.img")):
        return snapshot_dir
    return next((p.parent for p in sorted(snapshot_dir.rglob("pagemap-*.img"))), None)


def memory_text(rows: list[MemoryRow]) -> str:
    """A table of `rows`, their sum last."""
    def line(pid: str, mb: float, areas: object, runs: object, windows: object,
             kind: str) -> str:
        return f"{pid:>8}  {mb:>10.1f}  {areas:>6}  {runs:>7}  {windows:>8}  {kind}".rstrip()

    lines = [f"{'PID':>8}  {'MB':>10}  {'AREAS':>6}  {'RUNS':>7}  {'2M':>8}  KIND"]
    lines += [line("-" if r.pid is None else str(r.pid), r.bytes / 1e6, r.areas, r.runs,
                   r.windows_2m, r.kind) for r in rows]
    lines.append(line("all", sum(r.bytes for r in rows) / 1e6, sum(r.areas for r in rows),
                      sum(r.runs for r in rows), sum(r.windows_2m for r in rows), ""))
    return "\n".join(lines)


def _file_names(files: Path) -> dict[int, str]:
    """Regular files by id, as files.img names them ({} without one)."""
    if not files.exists():
        return {}
    out = {}
    for msg in read_entries(files)[1]:
        f = dict(fields_all(msg))
        reg = f.get(3)
        if f.get(1) == _REG_FILE and isinstance(reg, bytes):
            name = dict(fields_all(reg)).get(6)
            if isinstance(name, bytes):
                out[int(f.get(2, 0))] = name.decode(errors="replace")
    return out


def _vmas(mm: Path, names: dict[int, str]) -> list[_Vma]:
    return sorted((_Vma(v.get(1, 0), v.get(2, 0), _kind(v.get(7, 0), v.get(4, 0), names))
                   for v in vma_entries(mm)), key=lambda v: v.start)


def _kind(status: int, shmid: int, names: dict[int, str]) -> str:
    if status & VMA_AREA_HEAP:
        return "heap"
    if status & VMA_AREA_STACK:
        return "stack"
    if status & VMA_AREA_MEMFD:
        return f"memfd {names.get(shmid, '?')}"
    if status & (VMA_FILE_PRIVATE | VMA_FILE_SHARED):
        return f"file {names.get(shmid, '?')}"
    if status & VMA_ANON_SHARED:
        return "shared"
    if status & VMA_ANON_PRIVATE:
        return "anonymous"
    return "other"


def _present(pagemap: Path) -> list[tuple[int, int]]:
    """(vaddr, pages) of each entry whose pages are in this image (not its parent's)."""
    entries = read_entries(pagemap)[1][1:]  # the first is the pagemap_head
    return [(vaddr, nr) for vaddr, nr, flags in map(pagemap_entry, entries)
            if flags & PE_PRESENT]


def _split(vmas: list[_Vma], starts: list[int], vaddr: int,
           nr: int) -> list[tuple[int, str, int, int]]:
    """The pages [vaddr, vaddr + nr pages) by the area each falls in (`vmas` sorted, `starts`
    their starts): (the area's index, or -1 outside every area; its kind; the first page's
    address; pages)."""
    out = []
    end = vaddr + nr * PAGE
    i = max(bisect.bisect_right(starts, vaddr) - 1, 0)
    at = vaddr
    while at < end:
        while i < len(vmas) and vmas[i].end <= at:
            i += 1
        v = vmas[i] if i < len(vmas) else None
        if v is None or at < v.start:
            # Outside every area CRIU listed: counted as such, never lost from the sum.
            stop, area, kind = (end if v is None else min(end, v.start)), -1, "other"
        else:
            stop, area, kind = min(end, v.end), i, v.kind
        out.append((area, kind, at, (stop - at) // PAGE))
        at = stop
    return out
