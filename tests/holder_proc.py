"""A real `pitstop holder --backend cpu` process for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent.errors import HolderUnavailableError
from agent.holder import protocol as p
from agent.holder.client import HolderClient

REPO = Path(__file__).resolve().parent.parent


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Holder:
    """A `pitstop holder --backend cpu` process on a private directory."""

    def __init__(self, base: Path, *args: str) -> None:
        self.base = base
        self.sock = base / "cpu" / p.SOCKET_NAME
        self.log = base.parent / f"{base.name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "holder", "--backend", "cpu", "--gpu", "cpu",
             "--dir", str(base), *args], cwd=REPO, stdout=self.log.open("w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(HolderUnavailableError), self.client() as c:
                c.stats()
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the holder did not come up:\n{self.log.read_text()}")
            time.sleep(0.05)

    def client(self) -> HolderClient:
        return HolderClient(self.sock, timeout=10)

    def stats(self) -> p.Stats:
        with self.client() as c:
            return c.stats()

    def fds(self) -> list[str]:
        """What the holder has open besides sockets, as readlink shows it.

        Session sockets come and go with the probes themselves; they are counted
        through `stats().sessions` instead.
        """
        d = Path(f"/proc/{self.proc.pid}/fd")
        out = []
        for e in d.iterdir():
            with contextlib.suppress(FileNotFoundError):
                out.append(os.readlink(e))
        return sorted(f for f in out if not f.startswith("socket:"))

    def settled_sessions(self) -> int:
        """Sessions besides the asking one, once the holder has seen the others close."""
        with contextlib.suppress(AssertionError):
            wait_for(lambda: self.stats().sessions == 1, "sessions to close", timeout=5)
        return self.stats().sessions - 1

    def memfds(self) -> list[str]:
        return [f for f in self.fds() if "memfd:pitstop:" in f]

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
