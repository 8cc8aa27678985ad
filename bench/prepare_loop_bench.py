"""How long the event loop stalls while the full restore chooses a snapshot (hashing it).

Publishes one snapshot of `--gib` GiB of random bytes in a real store, then times the full
restore's preparation `--runs` times with every file hashed (snapshots.verify: full): once
as the ladder runs it now (`await rung.prepare()`, in a worker thread) and once inline on
the loop, the way `skip_reason()` ran before. A 5 ms ticker on the same loop records the
longest gap between its ticks: the time health probes, the front and the watchdog wait.

    .venv/bin/python bench/prepare_loop_bench.py --gib 1 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.metrics import Metrics, new_registry  # noqa: E402
from agent.store import Manifest, ProcessTree, SnapshotStore  # noqa: E402
from agent.supervisor.ladder import Attempt, Prepared  # noqa: E402
from agent.supervisor.paths.restore import FullRestore  # noqa: E402
from tests.snapshot_helpers import CANARY, IDENT  # noqa: E402

TICK_S = 0.005


def _publish(store: SnapshotStore, gib: float) -> Manifest:
    with store.begin("full") as d:
        left = int(gib * 2**30)
        with open(d.dir / "pages-1.img", "wb") as f:
            while left > 0:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
        (d.dir / "core-1.img").write_bytes(b"core")
        m = Manifest(id=d.id, kind="full", created_at=datetime.now(UTC), identity=IDENT,
                     process=ProcessTree(root_pid=1, pids=(1,)), files=d.seal(),
                     chunk_bytes=d.chunk_bytes, timings={}, canary=CANARY)
        d.publish(m)
    return m


async def _stall(work: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """(seconds `work` took, the longest gap between two ticks of the loop meanwhile)."""
    gap, last = 0.0, time.monotonic()

    async def ticker() -> None:
        nonlocal gap, last
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            gap, last = max(gap, now - last), now

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    last = t0 = time.monotonic()
    result = await work()
    took = time.monotonic() - t0
    gap = max(gap, time.monotonic() - last)
    t.cancel()
    assert isinstance(result, Prepared), result
    return took, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="pitstop-preparebench-", dir=REPO / ".cache"
                              if (REPO / ".cache").is_dir() else None))
    rows = []
    try:
        store = SnapshotStore(d / "snaps", trust_sealed=False)
        store.open(clean=True)
        _publish(store, args.gib)
        snap = type("StoreOnly", (), {"store": store})()
        rung = FullRestore(snapshotter=snap, unavailable="", adapter=None,  # type: ignore
                           socket=d / "engine.sock", identity=lambda: IDENT,
                           metrics=Metrics(new_registry(), lambda: None),  # type: ignore
                           timeout_s=5)

        async def threaded() -> Any:
            return await rung.prepare(Attempt("bench"))

        async def inline() -> Any:
            return rung._choose()

        for name, work in (("prepare in a worker thread", threaded),
                           ("inline on the loop (before)", inline)):
            took, gaps = [], []
            for _ in range(args.runs):
                t, g = asyncio.run(_stall(work))
                took.append(t)
                gaps.append(g)
            rows.append({
                "engine": "none (store only)", "path": f"full: choose a snapshot, {name}",
                "gib": args.gib, "runs_s": [round(t, 4) for t in took],
                "median_s": round(statistics.median(took), 4),
                "loop_max_stall_s": [round(g, 4) for g in gaps],
                "median_loop_max_stall_s": round(statistics.median(gaps), 4),
                "machine": f"{platform.node()} {os.cpu_count()} cores {platform.release()}",
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
            })
            print(f"{rows[-1]['path']}: median {rows[-1]['median_s']:.3f} s, loop stalled at "
                  f"most {rows[-1]['median_loop_max_stall_s'] * 1e3:.1f} ms (median of "
                  f"{args.runs})")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    out = args.out or REPO / "bench" / "results" / f"{day}-prepare-loop-cpu.json"
    if out.exists():
        raise SystemExit(f"{out} exists: pass --out to write elsewhere")
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
