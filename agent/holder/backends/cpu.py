"""The cpu backend: one memfd per region, sized with ftruncate; the fd is what is passed."""

from __future__ import annotations

import mmap
import os

from agent.holder.backends.base import Allocation, BackendError

# memfd names show in /proc/<pid>/maps as "/memfd:<name> (deleted)": tests and operators
# find the holder's memory by this prefix.
MEMFD_PREFIX = "pitstop:"


class CpuBackend:
    """Host memory in memfds, so the whole protocol and hybrid path run on CPU machines."""

    name = "cpu"
    align = mmap.PAGESIZE

    def __init__(self, gpu: str = "cpu") -> None:
        self.gpu = gpu

    def allocate(self, name: str, size: int) -> Allocation:
        padded = -(-size // self.align) * self.align
        # MFD_CLOEXEC: nothing the holder might exec inherits the memory.
        fd = os.memfd_create(f"{MEMFD_PREFIX}{name}"[:249], os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, padded)
        except OSError as e:
            os.close(fd)
            raise BackendError(f"ftruncate of a {padded}-byte memfd failed: {e.strerror}") from e
        return Allocation(fds=[fd], chunks=[padded])

    def free(self, allocation: Allocation) -> None:
        # The pages go back once the last tenant mapping or fd of this memfd is gone too.
        for fd in allocation.fds:
            os.close(fd)
        allocation.fds.clear()

    def close(self) -> None:
        return None
