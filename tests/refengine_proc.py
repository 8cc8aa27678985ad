"""Start the reference engine as a real process on a Unix socket, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Engine:
    """A running `python -m agent.engines.refengine` on a Unix socket."""

    def __init__(self, proc: subprocess.Popen[bytes], socket: Path, name: str, log: Path):
        self.proc, self.socket, self.name, self.log = proc, socket, name, log

    def http(self, timeout: float = 60.0):  # -> httpx2.Client
        import httpx2

        transport = httpx2.HTTPTransport(uds=str(self.socket))
        return httpx2.Client(transport=transport, base_url="http://localhost", timeout=timeout)

    def openai(self):  # -> openai.OpenAI
        import openai

        return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                             http_client=self.http())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def run_engine(model: Path, *extra: str, name: str = "tiny", timeout: float = 60.0
               ) -> Iterator[Engine]:
    """Start the engine, wait for /health, stop it (SIGTERM, then SIGKILL) afterwards."""
    import httpx2

    # A short directory: a Unix socket path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(prefix="refengine-") as tmp:
        sock, log = Path(tmp) / "engine.sock", Path(tmp) / "engine.log"
        argv = [sys.executable, "-m", "agent.engines.refengine", "--model", str(model),
                "--uds", str(sock), "--served-model-name", name, "--device", "cpu", *extra]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        engine = Engine(proc, sock, name, log)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"engine exited with {proc.returncode}:\n"
                                       f"{engine.log_text()}")
                if sock.exists():
                    try:
                        with engine.http(timeout=2) as c:
                            if c.get("/health").status_code == 200:
                                break
                    except httpx2.TransportError:
                        pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine not healthy after {timeout}s:\n"
                                       f"{engine.log_text()}")
                time.sleep(0.1)
            yield engine
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
