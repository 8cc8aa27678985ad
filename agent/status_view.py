"""The status view: an immutable value, replaced on each change, that a scrape only reads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace

from agent.errors import HolderError, SnapshotError
from agent.gpu_health import Verdict
from agent.metrics import NodeInfo, StatusView
from agent.supervisor.states import State
from agent.supervisor.status import AgentStatus, HolderFacts, NewestSnapshot

log = logging.getLogger("pitstop.status")

# How often the holder is asked what it holds, and the store listed, besides after each change.
POLL_S = 5.0


class StatusBoard:
    """Publishes a `StatusView` built from the agent's status; I/O only off the event loop.

    The supervisor's changes (every state change: the end of a ladder walk, a capture and
    its prune) call `changed()`, which publishes at once from memory and asks for a fresh
    read of the store and the holder; `run()` does those reads in a worker thread, on
    request and every `poll_s`. `view()`, what the metrics collector calls at scrape time,
    returns the published value: a scrape never lists a directory or opens a socket, so
    it neither waits on a holder nor fails during a prune.

    Example::

        board = StatusBoard(status, node=lambda: NodeInfo(), read_store=store_newest)
        Metrics(registry, board.view)
        asyncio.ensure_future(board.run())
    """

    def __init__(self, status: AgentStatus, *, node: Callable[[], NodeInfo],
                 stale: Callable[[bool], tuple[str, ...]] = lambda present: (),
                 gpu_watched: Callable[[], bool] = lambda: False,
                 front_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 read_store: Callable[[], NewestSnapshot | None] | None = None,
                 read_holder: Callable[[], HolderFacts | None] | None = None,
                 on_facts: Callable[[], None] = lambda: None,
                 poll_s: float = POLL_S) -> None:
        self._status = status
        self._node = node
        self._stale = stale
        self._gpu_watched = gpu_watched
        self._front_counts = front_counts
        self._read_store = read_store
        self._read_holder = read_holder
        self._on_facts = on_facts
        self._poll_s = poll_s
        self._dirty = asyncio.Event()
        self._view = self._build()

    def view(self) -> StatusView:
        """The published view, with the front's two in-memory counters of this moment."""
        queued, inflight = self._front_counts()
        return replace(self._view, front_queue_depth=queued, front_inflight=inflight)

    def changed(self) -> None:
        """Something in the status changed: publish now, read the store and holder soon."""
        self.publish()
        self._dirty.set()

    def publish(self) -> None:
        self._view = self._build()

    def _build(self) -> StatusView:
        s = self._status
        newest, holder = s.newest_snapshot, s.holder
        return StatusView(
            state=s.state, engine_up=s.state == State.READY.value,
            engine_start_time=s.engine_ready_since, states=tuple(x.value for x in State),
            node=self._node(),
            snapshot_created=newest.created if newest else None,
            snapshot_bytes=newest.bytes_on_disk if newest else None,
            snapshot_kind=newest.kind if newest else "",
            stale_reasons=self._stale(newest is not None) if self._read_store else (),
            holder_up=holder.up if holder else None,
            holder_bytes=holder.bytes_held if holder else None,
            holder_bypassed=holder.bypassed if holder and holder.up else None,
            recovery_gpu_peak_bytes=tuple(sorted(s.gpu_peak_bytes.items())),
            gpu_usable=s.gpu != Verdict.UNUSABLE.value if self._gpu_watched() else None,
            standby_armed=s.standby.armed if s.standby is not None else None)

    def _read(self) -> tuple[NewestSnapshot | None, bool, HolderFacts | None]:
        """(newest snapshot, whether the store could be read, holder): in a worker thread."""
        newest, store_read = self._status.newest_snapshot, False
        if self._read_store is not None:
            try:
                newest, store_read = self._read_store(), True
            except (OSError, SnapshotError) as e:
                # Mid-prune a directory can vanish between listing and reading it: keep the
                # last answer and read again at the next change or poll.
                log.debug("cannot list the snapshot store: %s", e)
        holder = None
        if self._read_holder is not None:
            try:
                holder = self._read_holder()
            except HolderError:
                holder = HolderFacts(up=False)
        return newest, store_read, holder

    async def refresh(self) -> None:
        """Read the store and the holder off the loop, then publish what they said."""
        newest, store_read, holder = await asyncio.to_thread(self._read)
        s = self._status
        if not store_read and self._read_store is not None:
            newest = s.newest_snapshot
        if (newest, holder) == (s.newest_snapshot, s.holder):
            self.publish()
            return
        s.newest_snapshot, s.holder = newest, holder
        self.publish()
        self._on_facts()

    async def run(self) -> None:
        """Refresh at once, then on each change and every `poll_s`, until cancelled."""
        while True:
            self._dirty.clear()
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a status read must never end the agent
                log.exception("status refresh failed; trying again in %.0f s", self._poll_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self._poll_s)
