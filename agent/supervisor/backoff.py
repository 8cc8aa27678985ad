"""Backoff between starts, and the crash loop: the failures counted in a sliding window."""

from __future__ import annotations

import collections
from collections.abc import Callable

from agent.config import RestartConfig


class Failures:
    """The failed starts and engine failures of the last `restart.crash_loop_window_s`.

    Example::

        failures = Failures(time.monotonic)
        failures.record()
        delay, n = failures.delay(config.restart)   # 0 s for a first failure
        crash_loop = n > config.restart.crash_loop_limit
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._at: collections.deque[float] = collections.deque()

    def record(self) -> None:
        self._at.append(self._clock())

    def clear(self) -> None:
        self._at.clear()

    def delay(self, rc: RestartConfig) -> tuple[float, int]:
        """(seconds to wait, failures in the window); a first failure restarts at once,
        later ones wait backoff_initial_s x backoff_multiplier^(n-2), up to backoff_max_s."""
        now = self._clock()
        while self._at and now - self._at[0] > rc.crash_loop_window_s:
            self._at.popleft()
        n = len(self._at)
        if n <= 1:
            return 0.0, n
        return min(rc.backoff_max_s, rc.backoff_initial_s * rc.backoff_multiplier ** (n - 2)), n
