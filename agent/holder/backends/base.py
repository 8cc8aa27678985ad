"""The allocator backends' interface: what an allocation is, what a backend does, how it fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Allocation:
    """Memory the holder owns: one fd per chunk (chunk sizes in `chunks`), freed by `free`.

    The fds stay open in the holder for as long as the allocation lives; every attach
    sends the same fds again (the kernel duplicates them into the receiver).
    """

    fds: list[int]
    chunks: list[int]
    handle: object = None

    @property
    def size(self) -> int:
        return sum(self.chunks)


class Backend(Protocol):
    """Allocates and frees memory that can be passed as fds.

    Example::

        backend = make_backend("cpu", "cpu")
        a = backend.allocate("weights", 1 << 20)   # a.fds -> send to the writer
        backend.free(a)
    """

    name: str
    gpu: str
    align: int

    def allocate(self, name: str, size: int) -> Allocation:
        """Memory of at least `size` bytes; raises BackendError when there is none."""
        ...

    def free(self, allocation: Allocation) -> None:
        ...

    def close(self) -> None:
        ...


class BackendError(Exception):
    """The backend could not allocate or free; the message says why."""


class GpuFaultError(BackendError):
    """The driver reports a fault of the GPU; held memory can no longer be trusted."""
