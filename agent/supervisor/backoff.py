"""Backoff between starts, the crash loop (the failures counted in a sliding window), and
what passes between an engine's death and the walk that replaces it."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

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


class Lead:
    """From an engine's death being seen to the walk that replaces it: when it was seen
    (wall clock: Recovery.down_at) and what took the time since (Recovery.lead_s: the
    teardown of its tree, the backoff).

    Example::

        lead = Lead(time.monotonic)
        lead.down(engine.exited_at)
        with lead.span("teardown"):
            await engine.kill()
        down_at, lead_s = lead.take()   # for the recovery's record; cleared
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.down_at: float | None = None
        self.spans: dict[str, float] = {}

    def down(self, at: float) -> None:
        self.down_at, self.spans = at, {}

    @contextlib.contextmanager
    def span(self, what: str) -> Iterator[None]:
        t0 = self._clock()
        try:
            yield
        finally:
            self.spans[what] = self.spans.get(what, 0.0) + self._clock() - t0

    def take(self) -> tuple[float | None, dict[str, float]]:
        out = self.down_at, {k: round(v, 4) for k, v in self.spans.items()}
        self.down_at, self.spans = None, {}
        return out
