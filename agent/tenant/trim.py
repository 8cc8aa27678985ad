"""Before a checkpoint: give the memory an engine freed but still keeps back to the system.

A CRIU image holds every resident page of the process, and on a GPU the CUDA checkpoint
first moves the process's device memory into its host memory, so both end up in the image
and are read back page by page at every restore. Memory that was freed but kept for reuse
(glibc's heap and arenas, torch's CUDA caching allocator) is as large there as memory in
use. Giving it back costs a few milliseconds now and a few allocations later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
from dataclasses import dataclass

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only; musl has none
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int


@dataclass(frozen=True)
class Trimmed:
    """What one trim gave back."""

    host_bytes: int  # resident host memory before minus after
    gpu_bytes: int  # torch's CUDA cache given back to the driver

    def describe(self) -> str:
        return (f"gave back {self.host_bytes / 1e6:.1f} MB of host memory and "
                f"{self.gpu_bytes / 1e6:.1f} MB of cached GPU memory")


def resident_bytes() -> int:
    """This process's resident set, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def give_back(cuda: bool) -> Trimmed:
    """Collect garbage, empty torch's CUDA caches (`cuda`), trim glibc's heap.

    Only free memory goes: torch.cuda.empty_cache() releases device blocks no tensor uses
    (CUDA graph pools stay with their graphs), torch's pinned host cache likewise, and
    malloc_trim(0) releases free heap pages.
    """
    before = resident_bytes()
    gc.collect()
    gpu = 0
    if cuda:
        import torch

        reserved = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        gpu = reserved - torch.cuda.memory_reserved()
        # Pinned host blocks torch keeps for reuse (its host caching allocator): host
        # memory the CUDA driver holds locked, dumped like any other.
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
    if _malloc_trim is not None:
        _malloc_trim(0)
    return Trimmed(host_bytes=max(0, before - resident_bytes()), gpu_bytes=gpu)
