"""What a metrics scrape costs now that it reads the status view, and what the reads it no
longer does (list the store, ask the holder) cost, with the holder answering and stopped.

Builds the real agent wiring in this process (snapshots on, a real CPU holder), publishes
`--snapshots` snapshots into its store, then times `generate_latest` (a scrape) and
`StatusBoard.refresh` (the store listing and holder poll, which ran in every scrape before
and now run in a worker thread after each change and every 5 s). Then SIGSTOPs the holder
and times both again: the poll waits for its 2 s timeout, the scrape does not.

    .venv/bin/python bench/scrape_bench.py --runs 20 --snapshots 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client import generate_latest  # noqa: E402

from agent.config import parse_config  # noqa: E402
from agent.systemd import Notifier  # noqa: E402
from agent.wiring import Agent  # noqa: E402
from tests.agentproc import agent_config  # noqa: E402
from tests.conftest import cached_model  # noqa: E402
from tests.holder_proc import Holder  # noqa: E402
from tests.snapshot_helpers import publish  # noqa: E402


def _time(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(round(time.perf_counter() - t0, 6))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--stopped-runs", type=int, default=3,
                    help="runs with the holder stopped (each poll waits its 2 s timeout)")
    ap.add_argument("--snapshots", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    command = "python bench/scrape_bench.py " + " ".join(sys.argv[1:])
    machine = f"vm {os.cpu_count()} cores {platform.release()}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        holder = Holder(tmp / "holder")
        try:
            cfg = parse_config(agent_config(tmp, cached_model(), holder={
                "enabled": True, "dir": str(holder.base), "gpu": "cpu"}), "bench")
            agent = Agent.start(cfg, None, Notifier({}))
            assert agent.snapshotter is not None, "no CRIU: run `make criu` first"
            for i in range(args.snapshots):
                publish(agent.snapshotter.store, size=1 << 20, minutes=i)
            assert agent.store.retention is not None
            agent.store.retention = dataclasses.replace(agent.store.retention,
                                                        keep=args.snapshots)

            def refresh() -> None:
                asyncio.run(agent.board.refresh())

            def scrape() -> None:
                generate_latest(agent.registry)

            refresh()
            cases = [("scrape (reads the status view)", scrape, args.runs),
                     ("store listing + holder poll (each scrape's reads before)", refresh,
                      args.runs)]
            for path, fn, runs in cases:
                runs_s = _time(fn, runs)
                rows.append({"path": f"{path}, holder answering", "runs_s": runs_s})
            os.kill(holder.proc.pid, signal.SIGSTOP)
            try:
                for path, fn, runs in cases:
                    runs_s = _time(fn, runs if fn is scrape else args.stopped_runs)
                    rows.append({"path": f"{path}, holder SIGSTOPped", "runs_s": runs_s})
            finally:
                os.kill(holder.proc.pid, signal.SIGCONT)
        finally:
            holder.stop()
    for r in rows:
        r.update(engine="reference", gib=0.0, median_s=round(statistics.median(r["runs_s"]), 6),
                 machine=machine, command=command, snapshots=args.snapshots)
        print(f"{r['path']}: median {r['median_s'] * 1e3:.2f} ms over {len(r['runs_s'])} runs")
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    out = args.out / f"{day}-scrape-cpu.json"
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
