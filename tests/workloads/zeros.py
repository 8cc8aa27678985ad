"""A CRIU test workload whose memory is partly zeros: private anonymous pages written with
zeros, pages with content between them, and a private mapping of a file whose page was
written with zeros. Answers "sum" over a Unix socket with a digest of all of it."""

import hashlib
import mmap
import os
import sys

from serve import serve

path, backing = sys.argv[1], sys.argv[2]
PAGE, PAGES = 4096, 4096  # 16 MiB
anon = mmap.mmap(-1, PAGE * PAGES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(PAGES):
    # Every page is touched (present in memory), two of three then zeroed again.
    anon[i * PAGE:(i + 1) * PAGE] = os.urandom(PAGE)
    if i % 3:
        anon[i * PAGE:(i + 1) * PAGE] = bytes(PAGE)
with open(backing, "wb") as f:
    f.write(b"\xab" * (4 * PAGE))
with open(backing, "r+b") as f:
    filemap = mmap.mmap(f.fileno(), 4 * PAGE, flags=mmap.MAP_PRIVATE)
filemap[PAGE:2 * PAGE] = bytes(PAGE)  # a zero page over a file of 0xab: must stay zeros


def digest() -> str:
    return hashlib.sha256(bytes(anon) + bytes(filemap)).hexdigest()


def answer(message: bytes) -> bytes | None:
    if not message.startswith(b"sum"):
        return None
    return f"{digest()} {filemap[PAGE]} {filemap[0]}\n".encode()


serve(path, answer)
