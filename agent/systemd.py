"""sd_notify only: READY, STATUS, WATCHDOG, EXTEND_TIMEOUT_USEC, STOPPING, RELOADING."""

from __future__ import annotations

import os
import time

import sdnotify


class Notifier:
    """Talks to systemd when run under it; every call is a no-op otherwise.

    Example::

        n = Notifier()
        n.status("starting: cold start")
        n.ready()
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        own = not pid or pid == str(os.getpid())
        self.watchdog_s: float | None = int(usec) / 1e6 if usec.isdigit() and own else None
        self._n = sdnotify.SystemdNotifier() if self.enabled else None

    def _send(self, msg: str) -> None:
        if self._n is not None:
            self._n.notify(msg)

    def ready(self, status: str = "") -> None:
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        # One line: sd_notify ends a field at the newline, and systemctl would show a stub.
        self._send(f"STATUS={' '.join(text.split())}")

    def watchdog(self) -> None:
        if self.watchdog_s is not None:
            self._send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        self._send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def reloading(self) -> None:
        # Type=notify-reload wants the monotonic stamp; plain notify ignores it.
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def reloaded(self) -> None:
        self._send("READY=1")
