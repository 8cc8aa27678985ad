"""A tiny real Type=notify program standing in for `pitstop run` and `pitstop holder`.

It pins the units' mechanics, not the agent's logic: READY=1 after a delay, WATCHDOG=1 pings
at a third of WATCHDOG_USEC, RELOADING=1/READY=1 on SIGHUP, and on SIGTERM STOPPING=1, a
drain, then a stop of its own child (the "engine") with SIGUSR1. Its settings sit beside the
units' --config file, in stand-in.json: {"ready_after_s": 2, "events": "/srv/t/events"}. Every
event is appended to that file as "<pid> <event>", so tests see what happened in which process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import sdnotify

ENGINE = """
import os, signal, sys, time
events = sys.argv[1]
def note(what):
    with open(events, "a") as f:
        f.write(f"{os.getpid()} {what}\\n")
# SIGTERM from systemd would mean KillMode let it reach the engine behind the agent's back.
signal.signal(signal.SIGTERM, lambda *_: (note("engine-got-sigterm"), sys.exit(1)))
signal.signal(signal.SIGUSR1, lambda *_: (note("engine-stopped-by-agent"), sys.exit(0)))
note("engine-up")
while True:
    time.sleep(1)
"""


def main(argv: list[str]) -> int:
    mode = argv[0]
    notifier = sdnotify.SystemdNotifier()
    if mode == "holder":
        print(f"sd_notify_prog holder: holding {argv[argv.index('--gpu') + 1]}", file=sys.stderr)
        notifier.notify("READY=1\nSTATUS=holding")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        signal.sigwait({signal.SIGTERM})
        return 0

    config = Path(argv[argv.index("--config") + 1])
    cfg = json.loads((config.parent / "stand-in.json").read_text())
    events = cfg.get("events")

    def note(what: str) -> None:
        print(f"sd_notify_prog {mode}: {what}", file=sys.stderr, flush=True)
        if events:
            with open(events, "a") as f:
                f.write(f"{os.getpid()} {what}\n")

    note("start")
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, events or "/dev/null"])
    # SIGTERM is taken synchronously (sigtimedwait) so a stop is seen at once, between pings.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def on_hup(*_: object) -> None:
        notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        note("reload")
        notifier.notify("READY=1")

    signal.signal(signal.SIGHUP, on_hup)
    # Pretend to walk the ladder: long enough to see the unit stay 'activating'.
    time.sleep(float(cfg.get("ready_after_s", 0)))
    notifier.notify("READY=1\nSTATUS=ready (stand-in)")
    note("ready")
    usec = os.environ.get("WATCHDOG_USEC")
    period = int(usec) / 1e6 / 3 if usec else 1.0
    while True:
        notifier.notify("WATCHDOG=1")
        if signal.sigtimedwait({signal.SIGTERM}, period) is not None:
            break
    notifier.notify("STOPPING=1")
    note("draining")
    time.sleep(0.5)
    engine.send_signal(signal.SIGUSR1)
    engine.wait(10)
    note("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
