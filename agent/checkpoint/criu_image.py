"""Reading CRIU's image files: their entries, and the protobuf fields of each.

The image formats (criu/images/*.proto): each image file starts with two 32-bit magics,
then entries, each a 32-bit length and a protobuf message. Only what Pitstop reads is
decoded, by field number, so no protobuf schema or library is needed.
"""

from __future__ import annotations

import struct
from pathlib import Path

PAGE = 4096
# criu/include/pagemap.h: a pagemap entry's flags.
PE_PARENT = 1 << 0
PE_PRESENT = 1 << 2
# criu/include/image.h: the status bits of a vma_entry.
VMA_AREA_REGULAR = 1 << 0
VMA_AREA_STACK = 1 << 1
VMA_AREA_HEAP = 1 << 5
VMA_FILE_PRIVATE = 1 << 6
VMA_FILE_SHARED = 1 << 7
VMA_ANON_SHARED = 1 << 8
VMA_ANON_PRIVATE = 1 << 9
VMA_AREA_MEMFD = 1 << 14


class ImageFormatError(Exception):
    """An image file is not laid out as this module expects (another CRIU's format, say);
    nothing was changed, and the image may still be sound."""


class ImageDamagedError(Exception):
    """An image file is cut short, or its pages and its pagemap disagree: the image as CRIU
    wrote it cannot be restored either; nothing was changed."""


def read_entries(path: Path) -> tuple[bytes, list[bytes]]:
    """The file's magics (8 bytes) and its entries' messages, in order."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise ImageDamagedError(f"{path}: too short for an image")
    magic, at, out = raw[:8], 8, []
    while at < len(raw):
        if at + 4 > len(raw):
            raise ImageDamagedError(f"{path}: an entry's length is cut off")
        (n,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + n > len(raw):
            raise ImageDamagedError(f"{path}: an entry runs past the end")
        out.append(raw[at:at + n])
        at += n
    return magic, out


def varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ImageFormatError("a varint is cut off")
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, at
        shift += 7


def fields_all(msg: bytes) -> list[tuple[int, int | bytes]]:
    """A protobuf message's fields in order: varints as ints, length-delimited as bytes."""
    out: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(msg):
        key, at = varint(msg, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = varint(msg, at)
            out.append((field, value))
        elif wire == 2:
            n, at = varint(msg, at)
            out.append((field, msg[at:at + n]))
            at += n
        elif wire == 1:
            out.append((field, int.from_bytes(msg[at:at + 8], "little")))
            at += 8
        elif wire == 5:
            out.append((field, int.from_bytes(msg[at:at + 4], "little")))
            at += 4
        else:
            raise ImageFormatError(f"protobuf wire type {wire} is not expected here")
    return out


def fields(msg: bytes) -> dict[int, int]:
    return {f: v for f, v in fields_all(msg) if isinstance(v, int)}


def pagemap_entry(msg: bytes) -> tuple[int, int, int]:
    """(vaddr, nr_pages, flags) of a pagemap_entry message."""
    f = fields(msg)
    # An entry without flags is of CRIU's older format: its `in_parent` (field 3) meant the
    # pages are in the parent image (CRIU's init_compat_pagemap_entry).
    return f.get(1, 0), f.get(5, f.get(2, 0)), f.get(4, PE_PARENT if f.get(3) else PE_PRESENT)


def vma_entries(mm: Path) -> list[dict[int, int]]:
    """The number fields of each vma_entry of an mm image (start 1, end 2, shmid 4: the
    file's id, status 7)."""
    _, entries = read_entries(mm)
    if len(entries) != 1:
        raise ImageFormatError(f"{mm}: {len(entries)} mm entries, expected 1")
    # repeated vma_entry vmas = 14
    return [fields(v) for f, v in fields_all(entries[0]) if f == 14 and isinstance(v, bytes)]
