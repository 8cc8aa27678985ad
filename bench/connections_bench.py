"""What the connection check before every dump costs: the survey of a serving engine's tree.

Starts the reference engine on a Unix socket, keeps `--noise` unrelated Unix socket pairs
open in this process (a busy host's sock_diag table is larger than the engine's), and times
`refuse_outside_connections` (one sock_diag dump, the tree's /proc fds and TCP tables).

    .venv/bin/python bench/connections_bench.py --runs 30 --noise 0,2000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.checkpoint.connections import refuse_outside_connections  # noqa: E402
from agent.checkpoint.snapshotter import tree_pids  # noqa: E402
from tests.conftest import cached_model  # noqa: E402


def _engine(model: Path, sock: Path) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-m", "agent.engines.refengine", "--model", str(model),
                          "--uds", str(sock), "--device", "cpu"], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if sock.exists():
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(sock))
                    s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    if s.recv(64).split(b" ")[1:2] == [b"200"]:
                        return p
                except OSError:
                    pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit("the reference engine did not become healthy in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--noise", default="0,2000", help="unrelated socket pairs, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="pitstop-connbench-"))
    engine = _engine(cached_model("tiny"), d / "engine.sock")
    rows = []
    try:
        tree = tree_pids(engine.pid)
        for noise in (int(n) for n in args.noise.split(",")):
            pairs = [socket.socketpair() for _ in range(noise)]
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                refuse_outside_connections(tree, settle_s=0)
                times.append(time.perf_counter() - t0)
            for a, b in pairs:
                a.close()
                b.close()
            rows.append({
                "engine": "reference", "path": f"connection-check, {noise} other socket pairs",
                "gib": 0.0, "runs_s": [round(t, 6) for t in times],
                "median_s": round(statistics.median(times), 6),
                "machine": f"{platform.node()} {os.cpu_count()} cores {platform.release()}",
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
            })
            print(f"{rows[-1]['path']}: median {rows[-1]['median_s'] * 1e3:.2f} ms "
                  f"over {args.runs} runs")
    finally:
        engine.kill()
        engine.wait()
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    out = args.out or REPO / "bench" / "results" / f"{day}-connection-check-cpu.json"
    if out.exists():
        raise SystemExit(f"{out} exists: pass --out to write elsewhere")
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
