"""The refill's read-rate cap (`pitstop holder --refill-rate`), shared by its threads."""

from __future__ import annotations

import threading
import time


class Throttle:
    """Caps the bytes a second all threads read together (`--refill-rate`), so a refill at
    boot leaves a shared disk to others; None: as fast as the storage allows.

    Example::

        throttle = Throttle(200e6, cancelled)   # 200 MB/s across every reader
        throttle.take(len(piece))                # before each read; returns when it may go
    """

    def __init__(self, rate: float | None, cancelled: threading.Event) -> None:
        self.rate = rate
        self._cancelled = cancelled
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._taken = 0

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            self._taken += n
            due = self._t0 + self._taken / self.rate
        while (wait := due - time.monotonic()) > 0:
            if self._cancelled.wait(min(wait, 0.1)):
                return
