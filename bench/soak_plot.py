"""The soak's recovery times by path, as a picture for docs/reliability.md.

    python bench/soak_plot.py bench/results/DATE-soak-cpu.json [--out docs/img/soak-recovery.png]

Needs matplotlib (`pip install -e '.[docs]'`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ("hybrid", "full", "warm", "cold")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "docs" / "img"
                    / "soak-recovery.png")
    args = ap.parse_args()
    r = json.loads(args.result.read_text())
    rows = {row["path"]: row["runs_s"] for row in r["rows"]}
    paths = [p for p in ORDER if p in rows] + sorted(set(rows) - set(ORDER))
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=120)
    for i, p in enumerate(paths):
        v = sorted(rows[p])
        # A strip of every recovery, jittered by rank, over a box of the quartiles.
        ax.scatter(v, [i + 0.25 * ((k % 9) / 8 - 0.5) for k in range(len(v))], s=6,
                   alpha=0.45, color="#5794f2", linewidths=0)
        ax.boxplot([v], positions=[i], orientation="horizontal", widths=0.5, showfliers=False,
                   medianprops={"color": "#f2495c"})
        s = r["recoveries"][p]
        ax.text(1.01, i, f"n={s['n']}  p50 {s['p50_s']:.2f}  p99 {s['p99_s']:.2f}  "
                f"max {s['max_s']:.2f} s", transform=ax.get_yaxis_transform(),
                va="center", fontsize=8)
    ax.set_yticks(range(len(paths)), paths)
    ax.set_xscale("log")
    ticks = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("recovery, crash noticed to engine verified (s, log scale)")
    ax.set_title(f"Soak: {r['failures_injected']} failures injected, "
                 f"{r['requests_sent']} requests, {r['requests_failed']} failed, "
                 f"{r['requests_wrong']} wrong", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.subplots_adjust(right=0.66)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
