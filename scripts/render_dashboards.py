"""Render the Grafana dashboards' panels from a real run as PNGs for the docs (no Grafana here).

Starts a private Prometheus (1 s scrapes, the alert rules with `for:` shortened) and three
`pitstop run` agents on the reference engine: two healthy ones whose engines are killed
and frozen a few times (crash and hang recoveries), and one whose engine can never pass its
health check (a crash loop). Then every panel of dashboards/pitstop-*.json is queried over
the run, with Grafana's variables filled in, and drawn at its place in the grid.

    .venv/bin/python scripts/render_dashboards.py --model .cache/tiny-llama --out docs/img
    .venv/bin/python scripts/render_dashboards.py --soak --minutes 4   # as docs/img has them

Needs matplotlib (`pip install -e '.[docs]'`) and Prometheus (scripts/install-prometheus.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from tests import promharness as ph  # noqa: E402

BAR_STEP_S = 20  # = the $__rate_interval the pictures use
STATE_COLORS = {"ready": "#73bf69", "starting": "#5794f2", "snapshotting": "#b877d9",
                "backoff": "#ff9830", "failed": "#f2495c", "stopping": "#8e8e9c",
                "stopped": "#8e8e9c"}
GRID_W, ROW_IN = 24, 0.42  # Grafana's 24 columns; inches per grid row in the picture
BG, PANEL_BG, FG, MUTED = "#111217", "#181b1f", "#ccccdc", "#8e8e9c"
PALETTE = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff",
           "#fade2a", "#ff780a", "#96d98d"]


# --- the run --------------------------------------------------------------------------------
def disturb(agent: ph.Agent, how: str) -> None:
    """Kill (a crash) or freeze (a hang) the agent's current engine."""
    pid = ph.wait_for("an engine to disturb", lambda: agent.status()["state"] == "ready"
                      and agent.status()["engine_pid"], timeout=120)
    print(f"  {how} engine {pid} of {agent.name}", flush=True)
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def run_scenario(work: Path, model: Path, python: str | None, minutes: float
                 ) -> tuple[ph.PrometheusServer, Any, float, float]:
    """Start everything, disturb the engines; return the server (still running) and span."""
    def cfg(name: str, **over: Any) -> dict[str, Any]:
        c = ph.agent_config(work / name, model, **over)
        if python:
            c["engine"]["python"] = python
        return c

    from contextlib import ExitStack

    stack = ExitStack()
    a = stack.enter_context(ph.running_agent(work, "gpu-node-1", cfg("gpu-node-1")))
    b = stack.enter_context(ph.running_agent(work, "gpu-node-2", cfg("gpu-node-2")))
    broken = stack.enter_context(ph.running_agent(work, "gpu-node-3", cfg(
        "gpu-node-3", health={"start_timeout_s": 0.3},
        restart={"crash_loop_limit": 3, "backoff_initial_s": 2.0, "backoff_max_s": 8.0})))
    rules = ph.short_for_rules(ph.RULES, work / "rules.yml", "5s")
    prom = stack.enter_context(ph.running_prometheus(
        work / "prom", {"gpu-node-1": a.metrics, "gpu-node-2": b.metrics,
                        "gpu-node-3": broken.metrics}, [rules]))
    start = time.time()
    plan = [(a, "kill"), (b, "kill"), (a, "freeze"), (b, "kill"), (a, "kill")]
    gap = minutes * 60 / (len(plan) + 1)
    for agent, how in plan:
        time.sleep(gap)
        disturb(agent, how)
    time.sleep(gap)
    return prom, stack, start, time.time()


def run_soak_scenario(work: Path, model: Path, minutes: float
                      ) -> tuple[ph.PrometheusServer, Any, float, float]:
    """gpu-node-1 is a soak node (bench/chaos.py: holder, front under load, snapshots) whose
    injector runs the mixed failure schedule for `minutes`; gpu-node-3 crash-loops, so that
    the fleet and alert panels have a broken node too."""
    import asyncio
    import shutil
    import threading
    from contextlib import ExitStack

    sys.path.insert(0, str(ph.REPO / "bench"))
    from chaos import DEFAULT_MIX, Injector, Load, Node, schedule

    stack = ExitStack()
    shutil.copytree(model, work / "soak-model")
    node = Node(work / "soak", work / "soak-model", store_mib=1024)
    node.start()
    stack.callback(node.stop)
    broken = stack.enter_context(ph.running_agent(work, "gpu-node-3", ph.agent_config(
        work / "gpu-node-3", model, health={"start_timeout_s": 0.3},
        restart={"crash_loop_limit": 3, "backoff_initial_s": 2.0, "backoff_max_s": 8.0})))
    st = asyncio.run(node.wait_for(lambda s: s.get("state") == "ready"
                                   and "published" in s.get("reason", ""), "a snapshot"))
    rules = ph.short_for_rules(ph.RULES, work / "rules.yml", "5s")
    prom = stack.enter_context(ph.running_prometheus(
        work / "prom", {"gpu-node-1": st["metrics"], "gpu-node-3": broken.metrics}, [rules]))
    start = time.time()
    done = threading.Event()

    async def soak() -> None:
        load = Load(f"http://{st['front']}")
        await load.references()
        load.start()
        inj = Injector(node, seed=4)
        await asyncio.sleep(20)  # a calm start: steady traffic before the first failure
        for kind in schedule(10_000, DEFAULT_MIX, seed=4):
            if time.time() - start > minutes * 60 - 20:
                break
            await inj.inject(kind)
            await asyncio.sleep(2.0)
        await asyncio.sleep(15)
        t = await load.stop()
        print(f"  soak: {len(inj.done)} failures, {t.sent} requests, {t.failed} failed, "
              f"{t.wrong} wrong", flush=True)
        done.set()

    worker = threading.Thread(target=asyncio.run, args=(soak(),), daemon=True)
    worker.start()
    worker.join(minutes * 60 + 300)
    if not done.is_set():
        raise SystemExit("the soak scenario did not finish")
    return prom, stack, start, time.time()


# --- drawing ---------------------------------------------------------------------------------
def legend(fmt: str, labels: dict[str, str]) -> str:
    if fmt in ("", "__auto"):
        return ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def fmt_value(v: float, unit: str) -> str:
    if unit == "bytes":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024:
                return f"{v:.3g} {u}"
            v /= 1024
    if unit == "s":
        return f"{v:.3g} s" if v < 120 else f"{v / 60:.3g} min"
    return f"{v:.3g}"


def style(ax: Axes, title: str) -> None:
    ax.set_facecolor(PANEL_BG)
    ax.set_title(title, loc="left", color=FG, fontsize=9, fontweight="bold")
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(colors=MUTED, labelsize=7)
    ax.grid(color="#2c3235", linewidth=0.6)


def no_data(ax: Axes) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center", fontsize=10,
            transform=ax.transAxes)


def draw_timeseries(ax: Axes, p: dict[str, Any], prom: ph.PrometheusServer, span: tuple[float,
                    float], subs: dict[str, str]) -> None:
    unit = p["fieldConfig"]["defaults"].get("unit", "short")
    custom = p["fieldConfig"]["defaults"].get("custom", {})
    bars = custom.get("drawStyle") == "bars"
    # Bars one per rate window, as Grafana draws them at a matching interval.
    step = BAR_STEP_S if bars else 1
    n = 0
    stacked: dict[float, float] = {}
    for t in p["targets"]:
        for s in prom.query_range(ph.substitute(t["expr"], subs), span[0], span[1], step):
            xs = [float(x) - span[0] for x, _ in s["values"]]
            ys = [float(y) for _, y in s["values"]]
            if all(y != y for y in ys):
                continue  # all NaN: a quantile of no events
            color = PALETTE[n % len(PALETTE)]
            label = legend(t["legendFormat"], s["metric"])
            if bars:
                bottom = [stacked.get(x, 0.0) for x in xs]
                ax.bar(xs, ys, width=step * 0.8, color=color, label=label, alpha=0.85,
                       bottom=bottom)
                for x, y, b in zip(xs, ys, bottom, strict=True):
                    stacked[x] = b + y
            else:
                ax.plot(xs, ys, color=color, label=label, linewidth=1.2,
                        marker="o" if custom.get("showPoints") == "always" else None,
                        markersize=3)
            n += 1
    if n == 0:
        no_data(ax)
        return
    ax.set_xlabel("seconds into the run", color=MUTED, fontsize=7)
    if unit in ("s", "bytes"):
        ax.yaxis.set_major_formatter(lambda v, _: fmt_value(v, unit))
    ax.legend(fontsize=6, loc="upper left", facecolor=PANEL_BG, edgecolor=PANEL_BG,
              labelcolor=FG, ncol=2 if n > 4 else 1)


def draw_state_timeline(ax: Axes, p: dict[str, Any], prom: ph.PrometheusServer,
                        span: tuple[float, float], subs: dict[str, str]) -> None:
    up_map = any("0" in m.get("options", {}) for m in p["fieldConfig"]["defaults"].get(
        "mappings", []))
    rows: list[tuple[str, str, list[tuple[float, float]]]] = []
    for t in p["targets"]:
        for s in prom.query_range(ph.substitute(t["expr"], subs), span[0], span[1], 1):
            rows.append((legend(t["legendFormat"], s["metric"]), s["metric"].get("state", ""),
                         [(float(x) - span[0], float(y)) for x, y in s["values"]]))
    if not rows:
        no_data(ax)
        return
    rows.sort()
    for i, (_name, state, pts) in enumerate(rows):
        for x, y in pts:
            color = ("#73bf69" if y == 1 else "#f2495c") if up_map else \
                STATE_COLORS.get(state, PALETTE[i % len(PALETTE)])
            ax.barh(i, 1.0, left=x, height=0.7, color=color, linewidth=0)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7, color=FG)
    ax.set_xlim(0, span[1] - span[0])
    ax.set_xlabel("seconds into the run" + ("  (green: up, red: down)" if up_map else ""),
                  color=MUTED, fontsize=7)
    ax.invert_yaxis()


def instant(prom: ph.PrometheusServer, p: dict[str, Any], at: float,
            subs: dict[str, str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for t in p["targets"]:
        for s in prom.api("query", query=ph.substitute(t["expr"], subs), time=at)["result"]:
            out.append((t, s))
    return out


def draw_stat(ax: Axes, p: dict[str, Any], prom: ph.PrometheusServer, at: float,
              subs: dict[str, str]) -> None:
    unit = p["fieldConfig"]["defaults"].get("unit", "short")
    up_map = bool(p["fieldConfig"]["defaults"].get("mappings"))
    vals = instant(prom, p, at, subs)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    if not vals:
        no_data(ax)
        return
    for i, (t, s) in enumerate(vals[:4]):
        v = float(s["value"][1])
        text = ("up" if v == 1 else "down") if up_map else fmt_value(v, unit)
        color = ("#73bf69" if v == 1 else "#f2495c") if up_map else PALETTE[i]
        y = 1 - (i + 0.5) / len(vals[:4])
        ax.text(0.5, y + 0.08, text, color=color, ha="center", va="center", fontsize=16,
                fontweight="bold", transform=ax.transAxes)
        ax.text(0.5, y - 0.12, legend(t["legendFormat"], s["metric"]), color=MUTED,
                ha="center", va="center", fontsize=7, transform=ax.transAxes)


def draw_bargauge(ax: Axes, p: dict[str, Any], prom: ph.PrometheusServer, at: float,
                  subs: dict[str, str]) -> None:
    unit = p["fieldConfig"]["defaults"].get("unit", "short")
    vals = [(legend(t["legendFormat"], s["metric"]), float(s["value"][1]))
            for t, s in instant(prom, p, at, subs)]
    if not vals:
        no_data(ax)
        return
    vals.sort()
    ax.barh(range(len(vals)), [v for _, v in vals], color=PALETTE[:len(vals)])
    ax.set_yticks(range(len(vals)), [n for n, _ in vals], fontsize=7, color=FG)
    for i, (_, v) in enumerate(vals):
        ax.text(v, i, f" {fmt_value(v, unit)}", color=FG, va="center", fontsize=7)
    ax.invert_yaxis()


def draw_table(ax: Axes, p: dict[str, Any], prom: ph.PrometheusServer, at: float,
               subs: dict[str, str]) -> None:
    hidden = {"__name__", "job"}
    order: list[str] = []
    for tr in p.get("transformations", []):
        opts = tr.get("options", {})
        hidden |= {k for k, v in opts.get("excludeByName", {}).items() if v}
        order = sorted(opts.get("indexByName", {}), key=opts.get("indexByName", {}).get) \
            or order
    rows = [s["metric"] for _, s in instant(prom, p, at, subs)]
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    if not rows:
        no_data(ax)
        return
    cols = [c for c in order if c not in hidden] or sorted(
        {k for r in rows for k in r} - hidden)
    cols += sorted({k for r in rows for k in r} - hidden - set(cols))
    table = ax.table(cellText=[[r.get(c, "") or "-" for c in cols] for r in rows],
                     colLabels=cols, loc="upper center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    for cell in table.get_celld().values():
        cell.set_facecolor(PANEL_BG)
        cell.set_edgecolor("#2c3235")
        cell.get_text().set_color(FG)


def render(path: Path, prom: ph.PrometheusServer, span: tuple[float, float], out: Path,
           instance: str) -> Path:
    d = json.loads(path.read_text())
    subs = {"$__rate_interval": f"{BAR_STEP_S}s", "$__range": f"{int(span[1] - span[0])}s",
            "$instance": instance}
    panels = d["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(16, rows * ROW_IN + 0.6), facecolor=BG)
    shown = "all hosts" if instance == ".*" else instance
    fig.suptitle(f"{d['title']}  (real run, {int(span[1] - span[0])} s; {shown})", color=FG,
                 x=0.01, ha="left", fontsize=12)
    top = 1 - 0.6 / (rows * ROW_IN + 0.6)
    for p in panels:
        g = p["gridPos"]
        rect = (g["x"] / GRID_W + 0.004, top * (1 - (g["y"] + g["h"]) / rows) + 0.006,
                g["w"] / GRID_W - 0.008, top * g["h"] / rows - 0.012)
        if p["type"] == "row":
            fig.text(rect[0], rect[1] + rect[3] / 2, p["title"], color=FG, fontsize=11,
                     fontweight="bold", va="center")
            continue
        # Leave room for tick labels and the title inside the panel's rectangle.
        inner = (rect[0] + 0.03, rect[1] + 0.035 * 8 / rows, rect[2] - 0.035,
                 rect[3] - 0.06 * 8 / rows)
        ax = fig.add_axes(inner if p["type"] in ("timeseries", "state-timeline", "bargauge")
                          else rect)
        style(ax, p["title"])
        kind = p["type"]
        if kind == "timeseries":
            draw_timeseries(ax, p, prom, span, subs)
        elif kind == "state-timeline":
            draw_state_timeline(ax, p, prom, span, subs)
        elif kind == "stat":
            draw_stat(ax, p, prom, span[1], subs)
        elif kind == "bargauge":
            draw_bargauge(ax, p, prom, span[1], subs)
        elif kind == "table":
            draw_table(ax, p, prom, span[1], subs)
    target = out / f"{path.stem}.png"
    fig.savefig(target, dpi=80, facecolor=BG)
    plt.close(fig)
    return target


def render_alerts(prom: ph.PrometheusServer, span: tuple[float, float], out: Path) -> Path:
    fig, (up, alerts) = plt.subplots(2, 1, figsize=(12, 5), facecolor=BG,
                                     gridspec_kw={"height_ratios": [1, 1.3]})
    panel = {"fieldConfig": {"defaults": {"mappings": [{"options": {"0": {}, "1": {}}}]}},
             "targets": [{"expr": "pitstop_engine_up", "legendFormat": "{{instance}}"}]}
    style(up, "pitstop_engine_up")
    draw_state_timeline(up, panel, prom, span, {})
    panel = {"fieldConfig": {"defaults": {}}, "targets": [
        {"expr": 'ALERTS{alertstate="firing", alertname=~"PitstopEngineDown|PitstopCrashLoop"}',
         "legendFormat": "{{alertname}} firing on {{instance}}"}]}
    style(alerts, "Alerts firing (rules' for: shortened to 5 s)")
    draw_state_timeline(alerts, panel, prom, span, {})
    fig.tight_layout()
    target = out / "alerts-engine-down.png"
    fig.savefig(target, dpi=80, facecolor=BG)
    plt.close(fig)
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ph.MODEL_DIR,
                    help="model directory (made with `pitstop make-model` if missing)")
    ap.add_argument("--out", type=Path, default=ph.REPO / "docs" / "img")
    ap.add_argument("--minutes", type=float, default=3.0, help="length of the run")
    ap.add_argument("--engine-python", help="engine.python for the agents (default: this one)")
    ap.add_argument("--soak", action="store_true",
                    help="gpu-node-1 runs the soak (holder, front under load, mixed failures, "
                    "snapshots on a tmpfs): every snapshot, holder and front panel has data")
    args = ap.parse_args()
    model = ph.ensure_model(args.model.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pitstop-render-") as tmp:
        print(f"running the agents for {args.minutes:g} minutes ...", flush=True)
        if args.soak:
            prom, stack, start, end = run_soak_scenario(Path(tmp), model, args.minutes)
        else:
            prom, stack, start, end = run_scenario(Path(tmp), model, args.engine_python,
                                                   args.minutes)
        with stack:
            time.sleep(2)  # one more scrape and evaluation after the last event
            span = (start, end)
            for path in ph.DASHBOARDS:
                # The node dashboard as an operator opens it: one host selected.
                instance = "gpu-node-1" if path.stem == "pitstop-node" else ".*"
                print(f"wrote {render(path, prom, span, args.out, instance)}")
            print(f"wrote {render_alerts(prom, span, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
