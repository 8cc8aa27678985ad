"""Watch the host's identity while the engine runs and report when it drifts."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent.drift import Difference, compare, describe
from agent.errors import PitstopError
from agent.identity import HostIdentity, Identity
from agent.weights import WeightsDigester, cache_path_for

if TYPE_CHECKING:
    from agent.config import Config
    from agent.engines.base import EngineAdapter
    from agent.metrics import Metrics

log = logging.getLogger("pitstop.drift")

DEFAULT_INTERVAL_S = 30.0


class DriftWatcher:
    """Every `interval_s`, recompute the identity (in a worker thread: it stats the weight
    files and re-hashes only those that changed) and, when it differs from `reference`,
    call `on_drift(differences)` once per new set of differences.

    Example::

        watcher = DriftWatcher(reader, reference=identity_at_engine_start,
                               on_drift=supervisor.drifted, interval_s=30, metrics=metrics)
        task = asyncio.create_task(watcher.run())
        ...
        watcher.rebase(new_identity)   # after a regeneration: compare with the new one
    """

    def __init__(
        self,
        identify: Callable[[], Identity],
        reference: Identity,
        on_drift: Callable[[list[Difference]], Any],
        interval_s: float = DEFAULT_INTERVAL_S,
        metrics: Metrics | None = None,
    ) -> None:
        self._identify = identify
        self._reference = reference
        self._on_drift = on_drift
        self.interval_s = interval_s
        self._metrics = metrics
        self._reported: frozenset[tuple[str, str]] = frozenset()
        self._last_error: str | None = None
        self.checks = 0

    def reconfigure(self, config: Config) -> None:
        """snapshots.drift_check_interval_s, as a reload left it (0: `run` returns)."""
        self.interval_s = config.snapshots.drift_check_interval_s

    @property
    def reference(self) -> Identity:
        return self._reference

    def rebase(self, reference: Identity) -> None:
        """Compare with `reference` from now on (a fresh snapshot or engine matches it)."""
        self._reference = reference
        self._reported = frozenset()

    async def check(self) -> list[Difference]:
        """One round: the differences from the reference now ([] when none, or when the
        identity could not be read; that is logged). Reports a new set to on_drift."""
        reference = self._reference
        try:
            now = await asyncio.to_thread(self._identify)
        except (PitstopError, OSError) as e:
            # A file replaced while hashed, a package being installed: try at the next round.
            if str(e) != self._last_error:
                log.warning("drift check: cannot read the host identity: %s", e)
                self._last_error = str(e)
            return []
        self._last_error = None
        self.checks += 1
        if reference is not self._reference:
            return []  # rebased while we computed: this answer is for the old reference
        diffs = compare(reference, now)
        key = frozenset((d.field, repr(d.new)) for d in diffs)
        if not diffs:
            self._reported = frozenset()
        elif key != self._reported:
            # One event per field that newly differs, or differs with a new value.
            fresh = sorted({f for f, _ in key - self._reported})
            self._reported = key
            log.warning("drift: %s", describe(diffs))
            if self._metrics is not None:
                for name in fresh:
                    self._metrics.drift_events.labels(field=name).inc()
            try:
                result = self._on_drift(diffs)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("drift handler failed; watching on")
        return diffs

    async def run(self) -> None:
        """Check every interval until cancelled; an interval of 0 (config: off) returns,
        at once or, when a reload sets it, after the sleep in progress."""
        while self.interval_s > 0:
            await asyncio.sleep(self.interval_s)
            if self.interval_s <= 0:
                return
            try:
                await self.check()
            except Exception:
                # A bug here must not silently end drift detection for the agent's life.
                log.exception("drift check failed; trying again in %.0f s", self.interval_s)


def build_reader(config: Config, adapter: EngineAdapter, criu_version: str | None) -> HostIdentity:
    """The agent's identity reader: weights digested through the cache in paths.state_dir."""
    return HostIdentity(config, adapter, criu_version,
                        WeightsDigester(cache_path_for(config.paths.state_dir)))
