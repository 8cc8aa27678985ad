"""Write dashboards/pitstop-node.json and pitstop-fleet.json from the panel lists below.

The JSON files are committed; this script is their source. After editing a panel here run
`.venv/bin/python scripts/gen_dashboards.py` (tests/test_observability.py fails when the
committed JSON and this script disagree).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Grafana 12's dashboard schema; older Grafana (>= 10) migrates what it does not know.
SCHEMA_VERSION = 41
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Every selector carries this: the `instance` variable lists only the agents that serve the
# chosen `model` and `engine` (the metrics themselves carry no model label; pitstop_node_info
# does). Each engine of a node is its own agent, so its own instance (host:metrics port); every
# metric of a named engine's agent carries `engine` (docs/metrics.md), a node's one agent none.
I = 'instance=~"$instance", engine=~"$engine"'  # noqa: E741
# A series' legend: the agent, and the engine on a node of several.
WHO = "{{instance}} {{engine}}"
ROOT = Path(__file__).resolve().parent.parent / "dashboards"


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False,
           table: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr,
                         "legendFormat": legend or "__auto", "range": not instant,
                         "instant": instant}
    if table:
        t["format"] = "table"
    return t


def panel(kind: str, title: str, desc: str, targets: list[dict[str, Any]], unit: str = "short",
          *, w: int = 12, h: int = 8, options: dict[str, Any] | None = None,
          custom: dict[str, Any] | None = None, mappings: list[dict[str, Any]] | None = None,
          transformations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if custom is BARS:
        # Event counts: the agent exports every known label set at 0 from the start, and
        # 48 zero series would crowd out the few that had events.
        for t in targets:
            t["expr"] = f"{t['expr']} > 0"
    if custom:
        defaults["custom"] = custom
    if mappings:
        defaults["mappings"] = mappings
    p: dict[str, Any] = {"type": kind, "title": title, "description": desc, "datasource": DS,
                         "targets": targets, "gridPos": {"w": w, "h": h},
                         "fieldConfig": {"defaults": defaults, "overrides": []},
                         "options": options or {}}
    if transformations:
        p["transformations"] = transformations
    return p


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"w": 24, "h": 1}}


def variables(instance_label: str) -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "definition": query, "query": {"query": query, "refId": f"{name}-values"},
                "refresh": 2, "includeAll": True, "multi": True, "sort": 1,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, **extra}

    return [
        {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "refresh": 1, "current": {}, "hide": 0},
        query_var("model", "Model", "label_values(pitstop_node_info, model)"),
        # "All" is `.*`, not the list of names: it must also match the agents of nodes with one
        # engine, whose series have no engine label.
        query_var("engine", "Engine", 'label_values(pitstop_node_info{model=~"$model"}, engine)',
                  allValue=".*"),
        query_var("instance", instance_label,
                  'label_values(pitstop_node_info{model=~"$model", engine=~"$engine"}, '
                  "instance)"),
    ]


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each panel an id and an x/y: left to right, wrapping at Grafana's 24 columns."""
    x = y = row_h = 0
    for n, p in enumerate(panels, start=1):
        gp = p["gridPos"]
        if p["type"] == "row" or x + gp["w"] > 24:
            y += row_h
            x = row_h = 0
        gp["x"], gp["y"] = x, y
        p["id"] = n
        x += gp["w"]
        row_h = max(row_h, gp["h"])
        if p["type"] == "row":
            y += gp["h"]
            x = row_h = 0
    return panels


def dashboard(uid: str, title: str, desc: str, panels: list[dict[str, Any]],
              instance_label: str) -> dict[str, Any]:
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "uid": uid, "title": title, "description": desc, "tags": ["pitstop"],
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True,
        "graphTooltip": 1, "refresh": "30s", "timezone": "",
        "time": {"from": "now-6h", "to": "now"}, "timepicker": {},
        "annotations": {"list": []}, "links": [
            {"title": "Pitstop dashboards", "type": "dashboards", "tags": ["pitstop"],
             "asDropdown": True}],
        "templating": {"list": variables(instance_label)},
        "panels": layout(panels),
    }


TS = "timeseries"
BARS = {"drawStyle": "bars", "fillOpacity": 60, "stacking": {"mode": "normal"}}
POINTS = {"drawStyle": "line", "showPoints": "always", "pointSize": 6, "spanNulls": False}
UP_MAP = [{"type": "value", "options": {"0": {"text": "down", "color": "red"},
                                        "1": {"text": "up", "color": "green"}}}]
# The holder's state: pitstop_holder_up plus pitstop_holder_bypassed.
HOLDER_MAP = [{"type": "value", "options": {**UP_MAP[0]["options"],
                                            "2": {"text": "bypassed", "color": "orange"}}}]
VERSION_COLUMNS = ["instance", "engine", "model", "driver_version", "cuda_driver_version", "kernel",
                   "gpu_name", "engine_kind", "engine_version", "weights_digest"]


def quantiles(metric: str, by: str, selector: str, legend: str) -> list[dict[str, Any]]:
    return [target(f"histogram_quantile({q}, sum by ({by}le) (rate({metric}_bucket{{{selector}}}"
                   f"[$__rate_interval])))", f"{legend} p{int(q * 100)}", ref)
            for ref, q in (("A", 0.5), ("B", 0.99))]


def node_panels() -> list[dict[str, Any]]:
    return [
        row("Engine"),
        panel("stat", "Engine up", "1 when the engine is verified and serving "
              "(pitstop_engine_up).", [target(f"pitstop_engine_up{{{I}}}", WHO)],
              w=4, h=6, mappings=UP_MAP, options={"colorMode": "background"}),
        panel("stat", "Serving for", "Time since the current engine became ready.",
              [target(f"time() - pitstop_engine_start_time_seconds{{{I}}}", WHO)],
              "s", w=4, h=6),
        panel("state-timeline", "Engine state", "The supervisor's state over time: a bar "
              "where the engine was in that state (pitstop_engine_state).",
              [target(f"pitstop_engine_state{{{I}}} == 1", f"{WHO} {{{{state}}}}")],
              w=16, h=6, options={"showValue": "never", "mergeValues": True},
              mappings=[{"type": "value", "options": {"1": {"text": "in state"}}}]),
        row("Recoveries"),
        panel(TS, "Recovery time by path (p50, p99)", "From the decision to (re)start the "
              "engine to its verified canary answer, successful recoveries, by ladder path.",
              quantiles("pitstop_recovery_duration_seconds", "path, ",
                        f'{I}, result="success"', "{{path}}"), "s", custom=POINTS),
        panel(TS, "Recoveries by cause", "Engine (re)starts by cause (startup, crash, hang, "
              "exit, reload) and result.",
              [target(f"sum by (cause, result) (increase(pitstop_recoveries_total{{{I}}}"
                      "[$__rate_interval]))", "{{cause}} {{result}}")], custom=BARS),
        panel(TS, "Recovery stages (p50)", "Time spent in each stage of a recovery: spawn, "
              "criu_restore, cuda_restore, attach, health, verify.",
              [target(f"histogram_quantile(0.5, sum by (stage, le) (rate("
                      f"pitstop_recovery_stage_duration_seconds_bucket{{{I}}}"
                      "[$__rate_interval])))", "{{stage}}")], "s", custom=POINTS),
        panel(TS, "Ladder fall-throughs", "A path skipped or failed, so the next one was "
              "tried, by path and reason.",
              [target(f"sum by (path, reason) (increase(pitstop_ladder_fallthroughs_total"
                      f"{{{I}}}[$__rate_interval]))", "{{path}} {{reason}}")], custom=BARS),
        panel(TS, "Engine failures by cause", "Failures the agent did not ask for: exit, "
              "crash, hang, gpu_fault (any of them while the GPU reported a fault), "
              "resume_failed (the engine could not take its weights back after a snapshot).",
              [target(f"sum by (cause) (increase(pitstop_engine_failures_total{{{I}}}"
                      "[$__rate_interval]))", "{{cause}}")], custom=BARS, h=6),
        panel("bargauge", "Peak GPU memory during recoveries", "GPU memory in use (every "
              "process, the holder's included) at its peak during the last recovery by each "
              "path: what a restore next to a live holder must fit in. Empty without a GPU.",
              [target(f"pitstop_recovery_gpu_memory_peak_bytes{{{I}}}",
                      f"{WHO} {{{{path}}}}", instant=True)], "bytes", h=6,
              options={"orientation": "horizontal", "displayMode": "gradient"}),
        row("Snapshots"),
        panel(TS, "Time since the last good snapshot", "Age of the newest usable snapshot; "
              "no line means none exists (see 'Snapshot present').",
              [target(f"pitstop_snapshot_age_seconds{{{I}}}", WHO)], "s", w=8),
        panel(TS, "Snapshot present and stale reasons", "1 when a usable snapshot exists, by "
              "kind; one line per reason the newest snapshot cannot be restored.",
              [target(f"max by (instance, engine, kind) (pitstop_snapshot_present{{{I}}})",
                      "present {{kind}}"),
               target(f"pitstop_snapshot_stale{{{I}}}", "stale: {{reason}}", "B")], w=8),
        panel(TS, "Snapshot size", "Size on disk of the newest usable snapshot.",
              [target(f"pitstop_snapshot_size_bytes{{{I}}}", WHO)], "bytes", w=8),
        panel(TS, "Drift, snapshots, regenerations", "Identity fields seen to drift, "
              "snapshots taken and regenerations, by outcome.",
              [target(f"sum by (field) (increase(pitstop_drift_events_total{{{I}}}"
                      "[$__rate_interval]))", "drift {{field}}"),
               target(f"sum by (kind, result) (increase(pitstop_snapshots_created_total{{{I}}}"
                      "[$__rate_interval]))", "snapshot {{kind}} {{result}}", "B"),
               target(f"sum by (result) (increase(pitstop_regenerations_total{{{I}}}"
                      "[$__rate_interval]))", "regeneration {{result}}", "C"),
               target(f"sum by (reason) (increase(pitstop_snapshots_rejected_total{{{I}}}"
                      "[$__rate_interval]))", "rejected {{reason}}", "D")], custom=BARS),
        panel(TS, "Snapshot time", "Time to take and publish one snapshot (p50, p99).",
              quantiles("pitstop_snapshot_create_duration_seconds", "kind, ", I, "{{kind}}"),
              "s", custom=POINTS),
        row("Holder"),
        panel(TS, "Held GPU memory", "Bytes of model memory the holder keeps outside the "
              "engine, so that a hybrid restore does not copy them.",
              [target(f"pitstop_holder_bytes{{{I}}}", WHO)], "bytes"),
        panel("state-timeline", "Holder up", "Whether the GPU memory holder answers, and "
              "whether the engine starts without it because the last start over it failed "
              "(bypassed: alert PitstopHolderBypassed).",
              [target(f"pitstop_holder_up{{{I}}} + (pitstop_holder_bypassed{{{I}}} or "
                      f"pitstop_holder_up{{{I}}} * 0)", WHO)], mappings=HOLDER_MAP,
              options={"showValue": "auto"}),
        row("GPU"),
        panel(TS, "GPU faults", "Faults of the engine's GPU seen through NVML (Xid, "
              "uncorrectable ECC, lost, reset required); a recovery after one reuses no held "
              "memory. Empty without a GPU.",
              [target(f"sum by (kind) (increase(pitstop_gpu_faults_total{{{I}}}"
                      "[$__rate_interval]))", "{{kind}}")], custom=BARS),
        panel("state-timeline", "GPU usable", "0 once NVML says the GPU is lost or needs a "
              "reset: the agent stopped in state failed.",
              [target(f"pitstop_gpu_usable{{{I}}}", WHO)],
              mappings=[{"type": "value", "options": {
                  "0": {"text": "lost or needs a reset", "color": "red"},
                  "1": {"text": "usable", "color": "green"}}}], options={"showValue": "auto"}),
        row("Front"),
        panel(TS, "Queue depth and in-flight", "Requests waiting in the front for a ready "
              "engine, and requests being forwarded.",
              [target(f"pitstop_front_queue_depth{{{I}}}", f"waiting {WHO}"),
               target(f"pitstop_front_inflight_requests{{{I}}}", f"in flight {WHO}",
                      "B")], w=8),
        panel(TS, "Front stalls (p50, p99)", "The pause a client saw while its answer was "
              "resumed across a recovery; and the queue wait before forwarding.",
              [*quantiles("pitstop_front_stall_seconds", "", I, "stall"),
               target("histogram_quantile(0.99, sum by (le) (rate("
                      f"pitstop_front_queue_wait_seconds_bucket{{{I}}}[$__rate_interval])))",
                      "queue wait p99", "C")], "s", w=8, custom=POINTS),
        panel(TS, "Requests", "Requests answered by code, resumed across a recovery, and "
              "failed by reason.",
              [target(f"sum by (code) (rate(pitstop_front_requests_total{{{I}}}"
                      "[$__rate_interval]))", "{{code}}"),
               target(f"sum(rate(pitstop_front_resumed_requests_total{{{I}}}"
                      "[$__rate_interval]))", "resumed", "B"),
               target(f"sum by (reason) (rate(pitstop_front_failed_requests_total{{{I}}}"
                      "[$__rate_interval]))", "failed {{reason}}", "C")], "reqps", w=8),
        panel("bargauge", "First token: after a recovery against steady state", "Mean time "
              "from forwarding a streamed request to its first token over the dashboard's "
              "range, by the path that started the engine: the first request each recovered "
              "engine answered (after_recovery) next to the others (steady).",
              [target(f"sum by (path, phase) (increase("
                      f"pitstop_front_time_to_first_token_seconds_sum{{{I}}}[$__range])) / "
                      "sum by (path, phase) (increase("
                      f"pitstop_front_time_to_first_token_seconds_count{{{I}}}[$__range]))",
                      "{{path}} {{phase}}", instant=True)], "s", w=24, h=7,
              options={"orientation": "horizontal", "displayMode": "gradient"}),
    ]


def fleet_panels() -> list[dict[str, Any]]:
    return [
        row("Fleet"),
        panel("stat", "Hosts serving", "Engines verified and serving, of those scraped "
              "(one per host, or each engine of a node of several).",
              [target(f"sum(pitstop_engine_up{{{I}}})", "serving"),
               target(f"count(pitstop_engine_up{{{I}}})", "engines", "B")], w=6, h=6),
        panel("stat", "Version sets", "Distinct (driver, kernel, engine) combinations: 1 "
              "when the pinning holds.",
              [target("count(count by (driver_version, kernel, engine_version) "
                      f"(pitstop_node_info{{{I}}}))", "version sets")], w=6, h=6),
        panel("state-timeline", "Engine up per host", "Each host's engines: up (serving) "
              "or down.", [target(f"pitstop_engine_up{{{I}}}", WHO)],
              w=12, h=6, mappings=UP_MAP, options={"showValue": "never"}),
        row("Recoveries"),
        panel(TS, "Recovery time by path (p50, p99)", "Successful recoveries across the "
              "selected hosts, by ladder path.",
              quantiles("pitstop_recovery_duration_seconds", "path, ",
                        f'{I}, result="success"', "{{path}}"), "s", custom=POINTS),
        panel("bargauge", "Recoveries by cause", "Recoveries in the dashboard's time range, "
              "by cause, path and result.",
              [target(f"sum by (cause, path, result) (increase(pitstop_recoveries_total{{{I}}}"
                      "[$__range])) > 0", "{{cause}} via {{path}}: {{result}}", instant=True)],
              options={"orientation": "horizontal", "displayMode": "basic"}),
        row("Snapshots and drift"),
        panel("bargauge", "Time since the last good snapshot", "Age of each host's newest "
              "usable snapshot; a host without one is missing here and listed at the right.",
              [target(f"pitstop_snapshot_age_seconds{{{I}}}", WHO, instant=True)],
              "s", w=8, options={"orientation": "horizontal", "displayMode": "gradient"}),
        panel("table", "Hosts without a usable snapshot", "Hosts whose newest snapshot is "
              "missing or stale, with the reason.",
              [target(f"max by (instance, engine) (pitstop_snapshot_present{{{I}}}) == 0", "",
                      instant=True, table=True),
               target(f"pitstop_snapshot_stale{{{I}}} == 1", "", "B", instant=True,
                      table=True)], w=8,
              transformations=[{"id": "merge", "options": {}}, {"id": "organize", "options": {
                  "excludeByName": {"Time": True, "job": True, "Value": True,
                                    "Value #A": True, "Value #B": True}}}]),
        panel(TS, "Drift across the fleet", "Identity fields seen to drift, summed over the "
              "selected hosts, and hosts with a stale snapshot by reason.",
              [target(f"sum by (field) (increase(pitstop_drift_events_total{{{I}}}"
                      "[$__rate_interval]))", "drift {{field}}"),
               target(f"count by (reason) (pitstop_snapshot_stale{{{I}}} == 1)",
                      "stale hosts: {{reason}}", "B")], w=8, custom=BARS),
        panel("table", "Versions per host", "pitstop_node_info: what each host runs. Join "
              "with DCGM on driver_version (DCGM_FI_DRIVER_VERSION).",
              [target(f"pitstop_node_info{{{I}}}", "", instant=True, table=True)], w=24, h=6,
              transformations=[{"id": "organize", "options": {
                  "excludeByName": {"Time": True, "Value": True, "job": True,
                                    "__name__": True},
                  "indexByName": {c: n for n, c in enumerate(VERSION_COLUMNS)}}}]),
        row("Holder and front"),
        panel(TS, "Held GPU memory", "Bytes each host's holder keeps outside the engine.",
              [target(f"pitstop_holder_bytes{{{I}}}", WHO)], "bytes", w=8),
        panel(TS, "Front stalls (p99) and resumed requests", "The pause clients saw while "
              "their answers were resumed across recoveries.",
              [target("histogram_quantile(0.99, sum by (le) (rate("
                      f"pitstop_front_stall_seconds_bucket{{{I}}}[$__rate_interval])))",
                      "stall p99"),
               target(f"sum(increase(pitstop_front_resumed_requests_total{{{I}}}"
                      "[$__rate_interval]))", "resumed", "B")], "s", w=8, custom=POINTS),
        panel(TS, "Front queue depth", "Requests waiting for a ready engine, per host.",
              [target(f"sum by (instance, engine) (pitstop_front_queue_depth{{{I}}})",
                      WHO)], w=8),
    ]


def build() -> dict[str, dict[str, Any]]:
    return {
        "pitstop-node.json": dashboard(
            "pitstop-node", "Pitstop / Node",
            "One host's engine: state, recoveries and their stages, snapshots, holder, front.",
            node_panels(), "Host"),
        "pitstop-fleet.json": dashboard(
            "pitstop-fleet", "Pitstop / Fleet",
            "Every host: who serves, how recoveries go, snapshot freshness, drift, versions.",
            fleet_panels(), "Hosts"),
    }


def render(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=False) + "\n"


def main() -> int:
    for name, d in build().items():
        (ROOT / name).write_text(render(d))
        print(f"wrote {ROOT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
