"""GPU smoke run of the full snapshot path: CUDA checkpoint + CRIU through the Snapshotter.

Not run by `make test` (no GPU on CI). On a GPU host with torch, cuda-bindings and
Pitstop's dependencies, from the repository root, after `make criu-bundle` here:

    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/gpu_snapshot_smoke.py OUTDIR [GPU_MIB]

It starts tests/workloads/counter.py holding GPU_MIB of GPU memory, snapshots it, kills
it, restores the image three times, checks each time that the count continued and the
GPU tensor's sum is intact, and writes OUTDIR/result.json with the timings. GPU_MIB 0
runs the same path on CPU, without CUDA (a dry run of this script).
"""

from __future__ import annotations

import json
import os
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
from agent.identity import collect  # noqa: E402
from agent.store import Canary, SnapshotStore  # noqa: E402


def ask(sock: Path) -> list[str]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(sock))
        s.sendall(b"inc\n")
        return s.recv(256).decode().split()


def wait_gone(pid: int) -> None:
    """Until the PID is free for the next restore: reaped, not only a zombie. A killed
    process with a CUDA context stays a zombie leader while its threads still tear down
    the context, and cannot be reaped before they are done."""
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        proc.reap_orphans()
        time.sleep(0.02)


def main() -> int:
    out = Path(sys.argv[1])
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    out.mkdir(parents=True, exist_ok=True)
    proc.become_subreaper()
    cuda = CudaCheckpoint()
    print("cuda checkpoint:", cuda.available(), flush=True)
    criu = CriuBackend(locate())
    snap = Snapshotter(SnapshotStore(out / "snapshots"), criu, cuda, log_dir=out / "logs")
    ident = collect(engine_kind="counter", engine_version="1", criu=criu.version)
    sock = out / "counter.sock"
    t0 = time.monotonic()
    gpu_args = ["--cuda", str(mib)] if mib else []  # GPU_MIB 0: a CPU dry run of this script
    p = subprocess.Popen(
        [sys.executable, str(REPO / "tests/workloads/counter.py"), str(sock), "0", *gpu_args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    assert p.stdout is not None
    print(p.stdout.readline().decode().strip(), flush=True)
    first = ask(sock)
    result: dict = {"gpu_mib": mib, "cold_start_s": time.monotonic() - t0, "first": first}
    canary = Canary(prompt="inc", max_tokens=1, text=first[0], token_ids=(int(first[0]),))
    info = take(snap.store, snap, CreateRequest("full", pid=p.pid, canary=canary), ident)
    p.wait()
    result["capture"] = {"timings": info.manifest.timings, "image_bytes": info.image_bytes}
    print("captured", result["capture"], flush=True)
    result["restores"] = []
    for _ in range(3):
        chosen = snap.store.select(ident).chosen
        assert chosen is not None
        t = time.monotonic()
        r = snap.restore(chosen)
        answer = ask(sock)
        rec = {"timings": r.timings, "to_answer_s": time.monotonic() - t, "answer": answer,
               "ok": answer[0] == str(int(first[0]) + 1) and answer[2:] == first[2:]}  # fmt: skip
        result["restores"].append(rec)
        print("restore", rec, flush=True)
        os.kill(r.pid, 9)
        wait_gone(r.pid)
        for f in set(r.outputs.values()):
            f.close()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0 if all(x["ok"] for x in result["restores"]) else 1


if __name__ == "__main__":
    sys.exit(main())
