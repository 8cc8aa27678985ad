"""CRIU image rewriting without zero pages, on images built here (tests/test_criu.py has
the real dump and restore): what is dropped, what is kept, and images left alone."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from agent.checkpoint.criu import CriuBackend
from agent.checkpoint.criu_image import (
    PAGE,
    PE_PRESENT,
    VMA_ANON_PRIVATE,
    VMA_AREA_REGULAR,
    ImageDamagedError,
    fields,
    read_entries,
)
from agent.checkpoint.snapshotter import Snapshotter
from agent.checkpoint.zeropages import _entry, _put_varint, drop_zero_pages
from agent.errors import SnapshotError
from agent.store import SnapshotStore
from tests.snapshot_helpers import criu

MAGIC = struct.pack("<II", 0x54564319, 0x56084025)
VMA_FILE_PRIVATE = 1 << 6


def _msg(*fields: tuple[int, int | bytes]) -> bytes:
    out = b""
    for f, v in fields:
        if isinstance(v, bytes):
            out += _put_varint(f << 3 | 2) + _put_varint(len(v)) + v
        else:
            out += _put_varint(f << 3) + _put_varint(v)
    return out


def _image(d: Path, vmas: list[tuple[int, int, int]], entries: list[bytes], pages: bytes) -> None:
    mm = _msg(*[(14, _msg((1, s), (2, e), (3, 0), (4, 0), (5, 3), (6, 0x22), (7, st),
                          (8, 1))) for s, e, st in vmas])
    (d / "mm-7.img").write_bytes(MAGIC + struct.pack("<I", len(mm)) + mm)
    head = _msg((1, 3))
    body = b"".join(struct.pack("<I", len(x)) + x for x in [head, *entries])
    (d / "pagemap-7.img").write_bytes(MAGIC + body)
    (d / "pages-3.img").write_bytes(pages)


def _page(byte: int) -> bytes:
    return bytes([byte]) * PAGE


def test_zero_pages_of_anonymous_memory_go_and_the_entries_split_around_them(tmp_path: Path):
    anon, file = VMA_AREA_REGULAR | VMA_ANON_PRIVATE, VMA_AREA_REGULAR | VMA_FILE_PRIVATE
    base = 0x7F0000000000
    # One entry over six pages: two anonymous areas around a file-backed one.
    _image(tmp_path, [(base, base + 3 * PAGE, anon), (base + 3 * PAGE, base + 4 * PAGE, file),
                      (base + 4 * PAGE, base + 6 * PAGE, anon)],
           [_entry(base, 6, PE_PRESENT)],
           _page(1) + _page(0) + _page(2) + _page(0) + _page(0) + _page(3))
    d = drop_zero_pages(tmp_path)
    assert (d.pages, d.dropped) == (6, 2)
    # The file-backed zero page stays: without it the restore would show the file's bytes.
    assert (tmp_path / "pages-3.img").read_bytes() == _page(1) + _page(2) + _page(0) + _page(3)
    _, entries = read_entries(tmp_path / "pagemap-7.img")
    got = [(f[1], f[5], f[4]) for f in map(fields, entries[1:])]
    assert got == [(base, 1, PE_PRESENT), (base + 2 * PAGE, 2, PE_PRESENT),
                   (base + 5 * PAGE, 1, PE_PRESENT)]
    assert fields(entries[0]) == {1: 3}
    assert drop_zero_pages(tmp_path) == type(d)(4, 0)  # nothing more to drop: unchanged


def test_an_image_shorter_than_its_pagemap_is_damaged_and_left_as_it_was(tmp_path: Path):
    anon = VMA_AREA_REGULAR | VMA_ANON_PRIVATE
    _image(tmp_path, [(0x10000, 0x10000 + 4 * PAGE, anon)], [_entry(0x10000, 4, PE_PRESENT)],
           _page(0) + _page(5))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ImageDamagedError, match="shorter than its pagemap"):
        drop_zero_pages(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_entry_of_the_older_format_whose_pages_are_in_the_parent_is_kept_as_it_is(
        tmp_path: Path):
    anon = VMA_AREA_REGULAR | VMA_ANON_PRIVATE
    base = 0x20000
    # No flags field, in_parent set (field 3): CRIU reads it as PE_PARENT, pages elsewhere.
    old = _msg((1, base), (2, 2), (3, 1))
    _image(tmp_path, [(base, base + 4 * PAGE, anon)],
           [old, _entry(base + 2 * PAGE, 2, PE_PRESENT)], _page(0) + _page(7))
    d = drop_zero_pages(tmp_path)
    assert (d.pages, d.dropped) == (2, 1)
    assert (tmp_path / "pages-3.img").read_bytes() == _page(7)
    _, entries = read_entries(tmp_path / "pagemap-7.img")
    assert entries[1] == old
    assert [(f[1], f[5], f[4]) for f in map(fields, entries[2:])] == [
        (base + 3 * PAGE, 1, PE_PRESENT)]


def test_a_damaged_dump_is_a_failed_snapshot_not_one_kept_as_written(tmp_path: Path):
    anon = VMA_AREA_REGULAR | VMA_ANON_PRIVATE
    _image(tmp_path, [(0x10000, 0x10000 + 4 * PAGE, anon)], [_entry(0x10000, 4, PE_PRESENT)],
           _page(0) + _page(5))
    snap = Snapshotter(SnapshotStore(tmp_path / "snaps"), CriuBackend(criu()), None)
    with pytest.raises(SnapshotError, match="damaged, not published.*shorter than its pagemap"):
        snap._drop_zero_pages(tmp_path, {})
