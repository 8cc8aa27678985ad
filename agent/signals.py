"""Signals and reload: what SIGTERM, SIGHUP and `pitstop reload` do to a running agent."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from agent import proc
from agent.config import DEFAULT_NAME, Config, load_config
from agent.errors import ConfigError
from agent.reload import ReloadResult, failed, plan
from agent.systemd import Notifier

log = logging.getLogger("pitstop")


class Reloader:
    """Reads the configuration file again and applies it through the reload policy.

    The file is read and validated in a worker thread, and so are the files it names that are
    read again at every reload (`prepare`: API keys, certificates), changed or not; `apply`
    then gets the configuration now in effect (changed keys that apply live, running values
    for the refused ones) and the report, on the event loop, and what `prepare` returned is
    called last. A ConfigError from any of them keeps everything as it was. One reload runs
    at a time.

    Example::

        reloader = Reloader(path, current=lambda: agent.config, apply=agent.reconfigure,
                            notifier=Notifier(), record=agent.record_reload)
        result = await reloader.reload()  # result.applied, result.refused
    """

    def __init__(self, path: Path | None, *, current: Callable[[], Config],
                 apply: Callable[[Config, ReloadResult], None], notifier: Notifier,
                 record: Callable[[ReloadResult], None],
                 prepare: Callable[[Config], Callable[[], None]] | None = None) -> None:
        self._path = path
        self._prepare = prepare
        self._current = current
        self._apply = apply
        self._notifier = notifier
        self._record = record
        self._lock = asyncio.Lock()

    async def reload(self) -> ReloadResult:
        async with self._lock:
            self._notifier.reloading()
            try:
                result = await self._reload()
            finally:
                self._notifier.reloaded()
            self._record(result)
            return result

    async def _reload(self) -> ReloadResult:
        source = str(self._path) if self._path is not None else DEFAULT_NAME
        try:
            new = await asyncio.to_thread(load_config, self._path)
            effective, result = plan(self._current(), new, source)
            commit = await asyncio.to_thread(self._prepare, effective) if self._prepare \
                else None
            self._apply(effective, result)
            if commit is not None:
                commit()
        except ConfigError as e:
            result = failed(source, str(e))
            log.error("%s", result.summary())
            self._notifier.status(result.summary()[:200])
            return result
        if result.refused:
            log.warning("%s", result.summary())
            for r in result.refused:
                log.warning("reload: %s keeps its running value: %s", r.key, r.why)
        else:
            log.info("%s", result.summary())
        return result


class Signals:
    """SIGTERM and SIGINT stop (draining first), SIGHUP reloads, SIGCHLD reaps orphans.

    Example::

        Signals(on_stop=agent.drain_then_stop, reloader=reloader).install()
    """

    def __init__(self, *, on_stop: Callable[[], None], reloader: Reloader) -> None:
        self._on_stop = on_stop
        self._reloader = reloader
        self._tasks: set[asyncio.Task[ReloadResult]] = set()

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_stop)
        loop.add_signal_handler(signal.SIGINT, self._on_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        loop.add_signal_handler(signal.SIGCHLD, lambda: proc.reap_orphans())

    def _on_hup(self) -> None:
        # Held until done: the loop keeps only a weak reference to a task.
        task = asyncio.ensure_future(self._reloader.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
