"""Real Prometheus servers and real `pitstop run` agents for the observability tests and docs."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests import agentproc

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "rules" / "pitstop.rules.yml"
DASHBOARDS = sorted((REPO / "dashboards").glob("pitstop-*.json"))
PROMETHEUS = "/usr/bin/prometheus"
PITSTOP = Path(sys.executable).with_name("pitstop")
MODEL_DIR = REPO / ".cache" / "tiny-llama"


def free_port() -> int:
    """A loopback port free right now (Prometheus cannot report a port it picked itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return r.read()


def wait_for(what: str, check: Any, timeout: float, every: float = 0.2) -> Any:
    """Poll `check()` until it returns something truthy; raise naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            last = check()
            if last:
                return last
        time.sleep(every)
    raise TimeoutError(f"{what}: not seen within {timeout:.0f}s (last: {last!r})")


# --- the model and the agent ----------------------------------------------------------------
def ensure_model(model: Path = MODEL_DIR) -> Path:
    """The tiny model, made once with `pitstop make-model` (idempotent) into `model`."""
    if not (model / "config.json").exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(PITSTOP), "make-model", str(model)], check=True, timeout=300)
    return model


def agent_config(tmp: Path, model: Path, **overrides: dict[str, Any]) -> dict[str, Any]:
    """tests/agentproc's config (ports from the kernel, state in `tmp`) with the front off:
    these tests look at the agent's metrics only."""
    return agentproc.agent_config(tmp, model, **{"front": {"enabled": False}, **overrides})


@dataclass
class Agent:
    """A running `pitstop run`; `metrics` is the host:port it bound, from status.json."""

    name: str
    proc: agentproc.RunningAgent
    metrics: str

    def status(self) -> dict[str, Any]:
        return self.proc.status()

    def scrape(self) -> str:
        return http_get(f"http://{self.metrics}/metrics").decode()


@contextlib.contextmanager
def running_agent(workdir: Path, name: str, config: dict[str, Any],
                  start_timeout: float = 60.0) -> Iterator[Agent]:
    """Start `pitstop run` on `config`; yield once its metrics port is known; stop it."""
    tmp = workdir / name
    tmp.mkdir(parents=True, exist_ok=True)
    proc = agentproc.RunningAgent(tmp, config)
    try:
        st = proc.wait_for(lambda s: s.get("metrics"), start_timeout, "the metrics port")
        yield Agent(name, proc, st["metrics"])
    finally:
        proc.stop()


# --- Prometheus -------------------------------------------------------------------------
@dataclass
class PrometheusServer:
    """A private Prometheus on 127.0.0.1; `url` is its base URL."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: Any) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(http_get(f"{self.url}/api/v1/{path}{query}", timeout=10))
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float,
                    step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]


def short_for_rules(src: Path, dst: Path, for_: str = "2s") -> Path:
    """A copy of `src` whose alerts wait `for_` instead of minutes, so a test sees them fire."""
    doc = yaml.safe_load(src.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = for_
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: list[str] | dict[str, str],
                       rule_files: list[Path], interval: str = "1s",
                       scrape_configs: list[dict[str, Any]] | None = None
                       ) -> Iterator[PrometheusServer]:
    """Prometheus scraping `targets` as job "pitstop" every `interval`, with `rule_files`.

    `targets` is a list of host:port (each its own `instance`), or {instance: host:port};
    `scrape_configs`, when given, are the jobs instead (TLS, basic auth: as an operator
    writes them).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if isinstance(targets, dict):
        static = [{"targets": [addr], "labels": {"instance": name}}
                  for name, addr in targets.items()]
    else:
        static = [{"targets": targets}]
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "scrape_timeout": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": scrape_configs or [{"job_name": "pitstop", "static_configs": static}],
    }
    cfg = workdir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d",
             # The test and the docs renderer look at minutes-old data: a 5 minute lookback
             # would smear a stopped series over the next 5 minutes of a short run.
             "--query.lookback-delta=5s"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    server = PrometheusServer(proc, f"http://127.0.0.1:{port}", log)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {proc.returncode}: "
                                   f"{log.read_text()[-2000:]}")
            return http_get(f"{server.url}/-/ready") is not None

        wait_for("prometheus ready", ready, 30)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def have_prometheus() -> bool:
    return shutil.which("promtool") is not None and Path(PROMETHEUS).exists()


# --- the expressions ---------------------------------------------------------------------
# Grafana's variables, replaced by values that keep each expression valid PromQL.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s",
                "$instance": ".*", "$model": ".*", "$engine": ".*",
                "${DS_PROMETHEUS}": "prometheus"}


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    values = {**GRAFANA_VARS, **(values or {})}
    # Longest first: $__rate_interval before a hypothetical $__rate.
    for var in sorted(values, key=len, reverse=True):
        expr = expr.replace(var, values[var])
    return expr


def dashboard_exprs(path: Path) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable of a dashboard."""
    d = json.loads(path.read_text())
    out: list[tuple[str, str]] = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            out.append((f"{path.name}: {p['title']} {t['refId']}", t["expr"]))
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"{path.name}: variable {v['name']}", v["definition"]))
    return out


def rule_exprs(path: Path) -> list[tuple[str, str]]:
    doc = yaml.safe_load(path.read_text())
    return [(f"{path.name}: {r.get('alert') or r.get('record')}", str(r["expr"]))
            for g in doc["groups"] for r in g["rules"]]


def recorded_names(paths: list[Path]) -> set[str]:
    return {r["record"] for p in paths for g in yaml.safe_load(p.read_text())["groups"]
            for r in g["rules"] if "record" in r}


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
# Words that are PromQL syntax, not series names, where they stand alone.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
             "offset", "and", "or", "unless", "atan2", "inf", "nan", "start", "end",
             # Aggregations may be followed by `by (...)` rather than by `(`.
             "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
             "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression (or Grafana's label_values()) selects.

    Strings, label matchers `{...}` and ranges `[...]` are dropped first; an identifier
    followed by `(` is a function or aggregation, and the parenthesised label list after
    by/without/on/ignoring/group_left/group_right is labels; what remains names series.
    """
    lv = re.match(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", expr)
    if lv is None and expr.strip().startswith("label_values("):
        raise ValueError(f"label_values() without a metric: {expr}")
    if lv is not None:
        return {lv.group(1)}
    text = _STRING.sub('""', substitute(expr))
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    names: set[str] = set()
    pos = 0
    while (m := _IDENT.search(text, pos)) is not None:
        word, pos = m.group(0), m.end()
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the tail of a number or duration: 1e3, 0.5, 5m
        rest = text[pos:].lstrip()
        if word.lower() in _GROUPING and rest.startswith("("):
            pos = text.index(")", pos) + 1
            continue
        if word.lower() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def exposed_names(exposition: str) -> set[str]:
    """Every series name a scrape can yield, from # TYPE lines and samples alike."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind == "summary":
                names |= {f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


# Series Prometheus itself adds to every scrape or evaluation.
PROMETHEUS_NAMES = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds",
                    "scrape_samples_scraped", "scrape_series_added"}
