"""The libc calls the cuda sink needs that Python's mmap module does not give: addresses."""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20
MADV_HUGEPAGE = 14


def mmap_address(length: int, fd: int, prot: int = mmap.PROT_READ,
                 flags: int = mmap.MAP_SHARED) -> int:
    """mmap(2), by default of a whole file, read-only and shared: the page cache's own
    pages (Python's mmap gives no address for a read-only map)."""
    addr = _libc.mmap(None, length, prot, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    return int(addr)


def munmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


def advise_huge_pages(addr: int, length: int) -> None:
    """MADV_HUGEPAGE: advice only, 4 KiB pages still work when the kernel has no huge ones."""
    _libc.madvise(addr, length, MADV_HUGEPAGE)
