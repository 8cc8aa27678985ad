"""What bounding the quarantine costs and saves: N snapshots of S MiB refused one after another.

Publishes `--snapshots` snapshots of `--mib` MiB each into a real store on disk and quarantines
each in turn, as a restore rung does with a corrupt image: once with the store's retention
(snapshots.quarantine_keep 2, the default) and once without (the agent before it). Times each
`quarantine` call (the move, the note, the record and, with retention, the prune) and reports
the bytes left in `.quarantine`.

    .venv/bin/python bench/quarantine_bench.py --snapshots 6 --mib 256 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.store import Retention, SnapshotStore  # noqa: E402
from agent.store.files import tree_bytes  # noqa: E402
from tests.snapshot_helpers import publish  # noqa: E402


def one_run(root: Path, n: int, size: int, retention: Retention | None) -> tuple[list[float], int]:
    store = SnapshotStore(root, retention=retention)
    store.open(clean=True)
    times = []
    for i in range(n):
        m = publish(store, size, minutes=i)
        t0 = time.perf_counter()
        store.quarantine(m.id, f"corrupt: bench {i}", "corrupt")
        times.append(time.perf_counter() - t0)
    left = tree_bytes(root / ".quarantine")
    return times, left


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshots", type=int, default=6)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (a real disk)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    size = args.mib << 20
    machine = f"vm {os.cpu_count()} cores {platform.release()}"
    command = (f"python bench/quarantine_bench.py --snapshots {args.snapshots} --mib {args.mib} "
               f"--runs {args.runs}")
    rows = []
    for label, retention in (
            ("quarantine, bounded (quarantine_keep 2)",
             Retention(keep=None, budget_bytes=1 << 40, quarantine_keep=2)),
            ("quarantine, unbounded (no retention)", None)):
        per_call: list[float] = []
        left_bytes = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                times, left = one_run(Path(tmp) / "snaps", args.snapshots, size, retention)
            per_call += times
            left_bytes.append(left)
        rows.append({
            "engine": "none", "path": label, "gib": round(size / 2**30, 3),
            "runs_s": [round(t, 6) for t in per_call],
            "median_s": round(statistics.median(per_call), 6), "machine": machine,
            "command": command, "snapshots": args.snapshots,
            "quarantine_bytes_left": max(left_bytes)})
        print(f"{label}: quarantine() median {rows[-1]['median_s'] * 1000:.1f} ms, "
              f"{max(left_bytes) / 2**20:.0f} MiB left in .quarantine after {args.snapshots}")
    out = args.out or REPO / "bench" / "results" / \
        f"{datetime.now(UTC):%Y-%m-%d}-quarantine-cpu.json"
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
