"""Before a checkpoint the tenant gives back memory it freed but kept: it is not dumped."""

from __future__ import annotations

import json
import subprocess
import sys

from agent.tenant.trim import give_back, resident_bytes

# In a fresh interpreter: the heap is then this test's alone.
HEAP = r"""
import ctypes, json, sys
from agent.tenant.trim import give_back, resident_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
block, count = 64 << 10, 2048  # 128 MiB in blocks below glibc's mmap threshold
blocks = [libc.malloc(block) for _ in range(count)]
for b in blocks:
    ctypes.memset(b, 1, block)
# One block above them keeps the heap's top in use, so free() cannot shrink the heap
# itself: the freed blocks stay resident, as a long-running engine's do.
top = libc.malloc(block)
ctypes.memset(top, 1, block)
for b in blocks:
    libc.free(b)
kept = resident_bytes()
t = give_back(cuda=False)
print(json.dumps({"freed": block * count, "kept": kept, "after": resident_bytes(),
                  "trimmed": t.host_bytes}))
"""


def test_heap_memory_freed_but_kept_by_malloc_is_given_back():
    out = subprocess.run([sys.executable, "-c", HEAP], capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout)
    # Without the trim these 128 MiB would be pages of the image.
    assert r["trimmed"] >= 0.8 * r["freed"], r
    assert r["after"] <= r["kept"] - 0.8 * r["freed"], r


def test_memory_in_use_stays_resident_and_intact():
    data = bytearray(64 << 20)
    data[::4096] = b"\x01" * len(data[::4096])
    t = give_back(cuda=False)
    assert resident_bytes() >= len(data)
    assert data.count(1) == len(data[::4096]) and t.gpu_bytes == 0
    assert "gave back" in t.describe()
