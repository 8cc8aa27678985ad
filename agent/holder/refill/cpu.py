"""The cpu backend's refill sink: reads land straight in the memfd regions mapped here."""

from __future__ import annotations

import mmap

from agent.holder.backends import Allocation
from agent.holder.refill import pread_into

ZEROS = bytes(1 << 20)


class CpuSink:
    """memfd regions, mapped into the holder for the load; reads land in them directly."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self.timings: dict[str, float] = {}

    def open(self, allocations: list[Allocation]) -> None:
        try:
            for a in allocations:
                [fd] = a.fds
                self._maps.append(mmap.mmap(fd, a.size, mmap.MAP_SHARED,
                                            mmap.PROT_READ | mmap.PROT_WRITE))
        except BaseException:
            self.close()
            raise
        self._views = [memoryview(m) for m in self._maps]

    def write(self, region: int, offset: int, fd: int, file_offset: int, length: int) -> None:
        pread_into(fd, self._views[region][offset:offset + length], file_offset)

    def put(self, region: int, offset: int, data: bytes) -> None:
        self._views[region][offset:offset + len(data)] = data

    def zero(self, region: int, offset: int, length: int) -> None:
        # A new memfd reads as zeros already; written anyway, so the sink owes nothing to
        # how the backend allocated it.
        view = self._views[region]
        for at in range(offset, offset + length, len(ZEROS)):
            n = min(len(ZEROS), offset + length - at)
            view[at:at + n] = ZEROS[:n]

    def finish(self) -> None:
        return None

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._views = []
        for m in self._maps:
            m.close()
        self._maps.clear()
