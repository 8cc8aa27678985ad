"""Start real vLLM from the adapter's launch spec for a test, wait until it serves, kill it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx2 as httpx

from agent import proc
from agent.config import parse_config
from agent.engines.vllm.adapter import VllmAdapter

REPO = Path(__file__).resolve().parent.parent
# Where scripts/install-vllm.sh (make vllm) puts vLLM; PITSTOP_VLLM_PYTHON points elsewhere.
VLLM_PYTHON = Path(os.environ.get("PITSTOP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
# On CPU the "GPU" fraction is a fraction of RAM, and eager mode skips compiling. The KV pool
# is given in bytes: from the fraction it came to 1.7 GiB of zeros on a 24 GiB machine, which
# every full image dumped, hashed, copied and restored; 64 MiB holds over 60,000 tokens of the
# tests' models (max-model-len 512). VLLM_CPU_KVCACHE_SPACE in an engine's env overrides it.
CPU_ARGS = ["--gpu-memory-utilization", "0.1", "--enforce-eager", "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(64 << 20)]
BOOT_TIMEOUT_S = 300.0


def vllm_adapter(tmp: Path, model: Path, name: str = "tiny", **engine: object) -> VllmAdapter:
    """An adapter for `engine.kind: vllm` on `model`, its socket under `tmp`."""
    cfg = {
        "engine": {
            "kind": "vllm",
            "model": str(model),
            "served_model_name": name,
            "python": str(VLLM_PYTHON),
            "socket": str(tmp / "vllm.sock"),
            "args": CPU_ARGS,
            **engine,
        },
        "paths": {"state_dir": str(tmp / "state")},
    }
    return VllmAdapter(parse_config(cfg, "<test>"))


class VllmServer:
    """One vLLM API server started from `adapter.launch_spec()`, in a session of its own."""

    def __init__(self, adapter: VllmAdapter, log: Path) -> None:
        self.adapter = adapter
        self.spec = adapter.launch_spec()
        assert self.spec.socket is not None
        self.socket = self.spec.socket
        self.log = log
        self.socket.unlink(missing_ok=True)
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                self.spec.argv,
                env={**os.environ, **self.spec.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own process group: the teardown kills EngineCore and workers with it.
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.boot_s: float | None = None

    def http(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), timeout=timeout)

    def get(self, path: str) -> httpx.Response:
        with self.http(timeout=5.0) as c:
            return c.get(f"http://localhost{path}")

    def post(self, path: str, body: dict) -> httpx.Response:
        with self.http() as c:
            return c.post(f"http://localhost{path}", json=body)

    def get_json(self, path: str, body: dict) -> dict:
        """The JSON answer to a POST of `body`; raises on an error status."""
        r = self.post(path, body)
        r.raise_for_status()
        return r.json()

    def wait_ready(self, timeout: float = BOOT_TIMEOUT_S) -> float:
        """Wait for /health 200 and the served model in /v1/models; the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"vLLM exited with {self.popen.returncode} while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if self.get(self.adapter.health_path).status_code == 200:
                    models = json.loads(self.get("/v1/models").content)["data"]
                    assert self.adapter.model_name() in [m["id"] for m in models]
                    self.boot_s = time.monotonic() - start
                    return self.boot_s
            time.sleep(0.5)
        raise AssertionError(f"vLLM not ready within {timeout:.0f}s:\n{self.log_tail()}")

    def children(self) -> dict[int, str]:
        """Live descendants of the API server and their process titles (VLLM::EngineCore...)."""
        out = {}
        for pid in proc.descendants(self.pid):
            with contextlib.suppress(OSError):
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                out[pid] = title
        return out

    def group(self) -> list[int]:
        """Live (non-zombie) processes of the server's process group, orphans included."""
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[2]) == self.pid and fields[0] != "Z":
                    pids.append(int(entry.name))
        return pids

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole process group, orphans included, and reap the API server."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.socket.unlink(missing_ok=True)
