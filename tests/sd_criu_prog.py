"""A stand-in `pitstop run` that dumps its "engine" with CRIU on stop and restores it on start.

It proves that the agent unit's sandbox (capabilities, seccomp deny-list, NoNewPrivileges,
ProtectSystem, a new mount namespace per invocation) lets CRIU dump a process tree in one
service invocation and restore it in the next, as the real agent does. Settings sit beside
the --config file in stand-in.json: {"criu": [argv...], "images": DIR, "events": FILE,
"count": FILE}. The engine is a shell loop that counts in memory and writes the count to a file.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import sdnotify

PR_SET_CHILD_SUBREAPER = 36
ENGINE = 'i=0; while :; do i=$((i+1)); echo "$i" > "$0"; sleep 0.1; done'


def _errors(log: Path) -> str:
    """CRIU's own error lines, which it writes to its log rather than to stderr."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no {log})"
    return " | ".join(line for line in lines if "Error" in line)[-1500:]


def main(argv: list[str]) -> int:
    config = Path(argv[argv.index("--config") + 1])
    cfg = json.loads((config.parent / "stand-in.json").read_text())
    criu, images = cfg["criu"], Path(cfg["images"])
    notifier = sdnotify.SystemdNotifier()

    def note(what: str) -> None:
        print(f"sd_criu_prog: {what}", file=sys.stderr, flush=True)
        with open(cfg["events"], "a") as f:
            f.write(f"{what}\n")

    # A restored tree is re-parented to the nearest subreaper: be it.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    if (images / "inventory.img").exists():
        pidfile = images / "restored.pid"
        r = subprocess.run([*criu, "restore", "-D", str(images), "-d", "-o", "restore.log",
                            "--pidfile", str(pidfile)], capture_output=True, text=True)
        if r.returncode != 0:
            note(f"restore-failed {r.stderr.strip()[-300:]} {_errors(images / 'restore.log')}")
            return 1
        engine = int(pidfile.read_text())
        # The next stop dumps into the same directory, and CRIU refuses to overwrite.
        for f in images.iterdir():
            if f.suffix == ".img" or f == pidfile:
                f.unlink()
        note(f"restored {engine}")
    else:
        engine = subprocess.Popen(["bash", "-c", ENGINE, cfg["count"]], start_new_session=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL).pid
        note(f"spawned {engine}")

    notifier.notify("READY=1")
    period = int(os.environ.get("WATCHDOG_USEC", "3000000")) / 1e6 / 3
    while signal.sigtimedwait({signal.SIGTERM}, period) is None:
        notifier.notify("WATCHDOG=1")
    notifier.notify("STOPPING=1")
    images.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([*criu, "dump", "-t", str(engine), "-D", str(images), "-o", "dump.log"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        note(f"dump-failed {r.stderr.strip()[-300:]} {_errors(images / 'dump.log')}")
        return 1
    # The dumped tree is gone (dump kills it); reap it since we are its subreaper or parent.
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    note(f"dumped {engine}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
