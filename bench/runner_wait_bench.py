"""How late the agent learns that a command ended: its runner (agent/commands.py, woken by
the kernel through a pidfd) beside `subprocess.Popen.wait(timeout)`, which the runner used
until 2026-12-07 and which polls with sleeps growing to 50 ms. A CRIU restore is such a
command, on the critical path of every restore. Not run by `make test`.

    python3 bench/runner_wait_bench.py [--seconds 0.1,0.3,0.6] [--runs 21] [--out DIR]

For each child length S, `sleep` runs RUNS times each way, the ways taken in turn, for S plus
0, 5, ..., 45 ms in turn (a restore's length falls anywhere between two of the polling
wait's wake-ups); a run's figure is the time from starting the child to having reaped it,
its lateness that less the child's sleep (its own exec and exit are in both ways alike):
`late_median_s`, `late_max_s`. Rows go to OUT/<date>-runner-wait-<machine>.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from gpu_recovery_bench import REPO
from lazy_restore_bench import restore_row, write_rows

from agent.commands import run


def by_runner(argv: list[str]) -> None:
    run(argv, timeout_s=60)


def by_polling_wait(argv: list[str]) -> None:
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    p.wait(timeout=60)


WAYS: dict[str, Callable[[list[str]], None]] = {
    "runner-pidfd": by_runner,
    "popen-wait-timeout": by_polling_wait,
}


def bench(a: argparse.Namespace) -> None:
    rows = []
    for secs in a.seconds:
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for n in range(a.runs):
            child = secs + (n % 10) * 0.005
            for way, fn in WAYS.items():
                t0 = time.monotonic()
                fn(["sleep", f"{child:.3f}"])
                wall = time.monotonic() - t0
                runs[way].append({"restore_s": wall, "late_s": wall - child})
        for way, got in runs.items():
            late = [r["late_s"] for r in got]
            row = restore_row(way, got, 0.0, child_s=secs,
                              late_median_s=round(statistics.median(late), 4),
                              late_max_s=round(max(late), 4))
            rows.append({**row, "engine": "none"})
    written = write_rows(a.out, "runner-wait", rows)
    for r in rows:
        print(f"{r['path']:>20} child {r['child_s']:g}-{r['child_s'] + 0.045:g} s: late "
              f"{r['late_median_s'] * 1e3:.1f} ms median, {r['late_max_s'] * 1e3:.1f} ms max")
    print(f"wrote {written}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.1, 0.3, 0.6])
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    bench(ap.parse_args())


if __name__ == "__main__":
    main()
