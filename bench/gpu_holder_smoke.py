"""GPU smoke run of the holder paths: load into the holder, warm start, hybrid restore.

Not run by `make test` (no GPU on CI). On a GPU host with torch, cuda-bindings and
Pitstop's dependencies, from the repository root, after `make criu-bundle` here:

    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/gpu_holder_smoke.py OUTDIR MODEL_DIR cuda

MODEL_DIR is a Llama directory (`pitstop make-model DIR --target-gib 8`). The script
starts `pitstop holder --backend cuda` for GPU 0, then the reference engine with
`--holder`: a first start loads the weights into the holder; the engine is SIGKILLed;
three more starts attach them (warm starts); the last is prepared (KV pool freed, held
weights detached), CUDA-checkpointed and dumped; the image is restored three times,
each followed by /pitstop/resume and the canary. OUTDIR/result.json has the timings.
With `cpu` instead of `cuda` the same path runs on CPU (a dry run of this script).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import proc  # noqa: E402
from agent.checkpoint.backend import CreateRequest, take  # noqa: E402
from agent.checkpoint.criu import CriuBackend  # noqa: E402
from agent.checkpoint.criu_locate import locate  # noqa: E402
from agent.checkpoint.cuda import CudaCheckpoint  # noqa: E402
from agent.checkpoint.snapshotter import Snapshotter  # noqa: E402
from agent.holder.client import HolderClient, holder_available  # noqa: E402
from agent.identity import collect  # noqa: E402
from agent.store import Canary, SnapshotStore  # noqa: E402

PROMPT = "Pitstop canary: the quick brown fox"
DIGEST = "sha256-smoke"


class _UnixHTTP(http.client.HTTPConnection):
    """The standard library's HTTP client over a Unix socket: nothing to carry to the host."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def call(sock: Path, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    c = _UnixHTTP(sock, timeout=120)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"content-type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        is_json = (r.getheader("content-type") or "").startswith("application/json")
        return r.status, json.loads(raw) if is_json else {"text": raw.decode()}
    finally:
        c.close()


def canary(sock: Path) -> str:
    code, body = call(sock, "POST", "/v1/completions",
                      {"model": "smoke", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert code == 200, body
    return body["choices"][0]["text"]


def gpu_uuid() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def start_engine(model: Path, sock: Path, device: str, holder_sock: Path) -> subprocess.Popen:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    with proc.spawn_lock():
        p = subprocess.Popen(
            [sys.executable, "-m", "agent.engines.refengine", "--model", str(model),
             "--uds", str(sock), "--served-model-name", "smoke", "--device", device,
             "--kv-slots", "4", "--max-model-len", "1024", "--holder", str(holder_sock),
             "--weights-digest", DIGEST],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=(sock.parent / "engine.log").open("a"),
            stderr=subprocess.STDOUT, start_new_session=True)
        proc.own(p.pid)
    return p


def wait_healthy(sock: Path, p: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p is not None and p.poll() is not None:
            log = (sock.parent / "engine.log").read_text()[-3000:]
            raise SystemExit(f"engine exited {p.returncode}: {log}")
        # Only "not up yet" is expected here; anything else must surface, not spin.
        with contextlib.suppress(OSError, http.client.HTTPException):
            if call(sock, "GET", "/health")[0] == 200:
                return
        time.sleep(0.05)
    raise SystemExit("engine not healthy in time")


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)  # our child, or re-parented to us (the subreaper) by a restore
    except ChildProcessError:
        deadline = time.monotonic() + 60
        while proc.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    proc.disown(pid)


def main() -> int:
    out, model, backend = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    proc.become_subreaper()
    device = "cuda" if backend == "cuda" else "cpu"
    gpu = gpu_uuid() if backend == "cuda" else "cpu"
    holder_dir = out / "holder"
    holder = subprocess.Popen([sys.executable, "-m", "agent", "holder", "--backend", backend,
                               "--gpu", gpu, "--dir", str(holder_dir)], cwd=REPO,
                              stdout=(out / "holder.log").open("w"), stderr=subprocess.STDOUT)
    hsock = holder_dir / gpu / "holder.sock"
    deadline = time.monotonic() + 60
    while holder_available(hsock) is not None:
        if holder.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"holder did not start: {(out / 'holder.log').read_text()}")
        time.sleep(0.1)
    result: dict = {"backend": backend, "model": str(model)}
    sock = out / "engine.sock"
    try:
        # One start that fills the holder, then three warm starts (the last one is kept
        # running to be prepared and dumped).
        result["warm_starts"] = []
        for i in range(4):
            t0 = time.monotonic()
            p = start_engine(model, sock, device, hsock)
            wait_healthy(sock, p)
            t1 = time.monotonic()
            answer = canary(sock)
            t2 = time.monotonic()
            st = call(sock, "GET", "/pitstop/state")[1]
            rec = {"to_healthy_s": t1 - t0, "canary_s": t2 - t1, "to_first_answer_s": t2 - t0,
                   "answer": answer, "weights_source": st["weights_source"]}
            if i == 0:
                result["load_into_holder"] = rec
            else:
                rec["ok"] = answer == result["load_into_holder"]["answer"]
                result["warm_starts"].append(rec)
            print("load_into_holder" if i == 0 else "warm_start", rec, flush=True)
            if i < 3:
                kill(p.pid)
        result["warm_start"] = result["warm_starts"][-1]
        with HolderClient(hsock) as c:
            result["held_bytes"] = c.stats().bytes_held
        cuda = CudaCheckpoint() if backend == "cuda" else None
        snap = Snapshotter(SnapshotStore(out / "snapshots"), CriuBackend(locate()), cuda,
                           log_dir=out / "logs")
        t0 = time.monotonic()
        code, body = call(sock, "POST", "/pitstop/prepare", {"timeout_s": 30})
        assert code == 200 and not body["held"]["attached"], body
        result["prepare_s"] = time.monotonic() - t0
        ident = collect(engine_kind="reference", engine_version="smoke",
                        criu=snap.criu.version)
        record = Canary(prompt=PROMPT, max_tokens=8, text=result["warm_start"]["answer"],
                        token_ids=())
        info = take(snap.store, snap, CreateRequest("hybrid", pid=p.pid, canary=record), ident)
        p.wait()
        proc.disown(p.pid)
        result["capture"] = {"timings": info.manifest.timings, "image_bytes": info.image_bytes}
        print("captured", result["capture"], flush=True)
        result["restores"] = []
        for _ in range(3):
            t0 = time.monotonic()
            r = snap.restore(info.manifest)
            t1 = time.monotonic()
            code, body = call(sock, "POST", "/pitstop/resume")
            t2 = time.monotonic()
            answer = canary(sock)
            t3 = time.monotonic()
            rec = {"timings": r.timings, "restore_s": t1 - t0, "resume_s": t2 - t1,
                   "canary_s": t3 - t2, "to_verified_answer_s": t3 - t0,
                   "resume_code": code, "ok": answer == result["warm_start"]["answer"]}
            result["restores"].append(rec)
            print("hybrid restore", rec, flush=True)
            kill(r.pid)
            for f in set(r.outputs.values()):
                f.close()
    finally:
        # An engine left by a failed step must not outlive the run (it holds the GPU).
        for pid in proc.children_of(os.getpid()):
            if pid != holder.pid:
                kill(pid)
        holder.send_signal(signal.SIGTERM)
        holder.wait(60)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    runs = result.get("restores", []) + result.get("warm_starts", [])
    return 0 if result.get("restores") and all(x["ok"] for x in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
