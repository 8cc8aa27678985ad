"""Metrics docs, alert rules and dashboards, checked against promtool and a real agent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from tests import promharness as ph
from tests.prereq import require

DOCS = ph.REPO / "docs" / "metrics.md"
RULE_TESTS = sorted((ph.REPO / "rules" / "tests").glob("*.yml"))
PIN_RULES = sorted((ph.REPO / "rules" / "pin").glob("*.yml"))


def catalogue_names() -> set[str]:
    """Every metric family agent/metrics.py defines, as the exposition names it."""
    view = StatusView(state="ready", engine_up=True, engine_start_time=0.0, states=("ready",),
                      node=NodeInfo())
    registry = new_registry()
    Metrics(registry, lambda: view)
    names = set()
    for family in registry.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names.add(family.name + suffix)
    return names


def documented_names() -> set[str]:
    """The names in the first column of docs/metrics.md's metric tables."""
    return set(re.findall(r"^\| `(pitstop_[a-z0-9_]+)`", DOCS.read_text(), re.M))


def test_every_metric_is_documented_and_every_documented_one_exists() -> None:
    defined, documented = catalogue_names(), documented_names()
    assert defined - documented == set(), "defined in agent/metrics.py, missing in docs"
    assert documented - defined == set(), "in docs/metrics.md, not defined in agent/metrics.py"


def test_every_refusal_code_is_documented_and_every_documented_one_exists() -> None:
    from agent.refusal import RefusalCode

    section = DOCS.read_text().split("## Refusal codes", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", section, re.M)
    assert len(documented) == len(set(documented)), "a code is listed twice"
    assert set(documented) == {c.value for c in RefusalCode}


def test_the_fronts_failure_reasons_are_documented_as_they_are_defined() -> None:
    from agent.front.holding import FrontFailure

    for doc in ("front.md", "metrics.md"):
        text = (ph.REPO / "docs" / doc).read_text()
        row = re.search(r"^\| `pitstop_front_failed_requests_total(?:\{reason\})?` \|(.*)$",
                        text, re.M)
        assert row is not None, f"docs/{doc} has no row for the failed requests"
        listed = [w for w in re.findall(r"`([a-z_]+)`", row.group(1)) if w != "reason"]
        assert listed == [f.value for f in FrontFailure], doc


def test_the_recovery_path_labels_are_the_names_of_the_rungs() -> None:
    # The metrics pre-create a series per rung name; a rung missing there would first appear
    # at 1, so its first recovery would have no increase() on the dashboards.
    import importlib
    import inspect

    from agent.metrics import RECOVERY_PATHS

    modules = [f"agent.supervisor.paths.{p.stem}"
               for p in (ph.REPO / "agent" / "supervisor" / "paths").glob("[!_]*.py")]
    names = set()
    for module in modules:
        for _, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass):
            if isinstance(getattr(cls, "name", None), str) and hasattr(cls, "prepare"):
                names.add(cls.name)
    assert len(RECOVERY_PATHS) == len(set(RECOVERY_PATHS))
    assert set(RECOVERY_PATHS) == names


def test_metric_names_follow_prometheus_conventions() -> None:
    for name in catalogue_names():
        assert ":" not in name, name
        assert re.fullmatch(r"pitstop_[a-z0-9_]+", name), name
        assert not re.search(r"_(ms|milliseconds|minutes|kb|mb|gb|mib|gib)(_|$)", name), \
            f"{name}: use base units (seconds, bytes)"


# --- rules ---------------------------------------------------------------------------------
def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120,
                          cwd=ph.REPO)


def need_prometheus() -> None:
    require(ph.have_prometheus(), "promtool/prometheus not installed: run "
            "scripts/install-prometheus.sh (make test does)")


def test_promtool_check_rules() -> None:
    need_prometheus()
    r = promtool("check", "rules", str(ph.RULES), *map(str, PIN_RULES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_test_rules() -> None:
    need_prometheus()
    r = promtool("test", "rules", *map(str, RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(ph.RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    assert alerts - firing == set(), "alerts without a test in which they fire"
    assert alerts - silent == set(), "alerts without a test in which they stay silent"


def test_every_alert_is_annotated_with_a_runbook_in_the_docs() -> None:
    alerts_doc = (ph.REPO / "docs" / "alerts.md").read_text().lower()
    for g in yaml.safe_load(ph.RULES.read_text())["groups"]:
        for r in g["rules"]:
            if "alert" not in r:
                continue
            ann = r["annotations"]
            assert ann.get("summary") and ann.get("description"), r["alert"]
            assert ann["runbook_url"] == f"docs/alerts.md#{r['alert'].lower()}"
            assert f"## {r['alert'].lower()}" in alerts_doc, f"{r['alert']} not in alerts.md"


# --- dashboards ----------------------------------------------------------------------------
def test_dashboards_are_what_the_generator_writes() -> None:
    sys.path.insert(0, str(ph.REPO / "scripts"))
    try:
        import gen_dashboards
    finally:
        sys.path.pop(0)
    for name, d in gen_dashboards.build().items():
        committed = (ph.REPO / "dashboards" / name).read_text()
        assert committed == gen_dashboards.render(d), \
            f"dashboards/{name} differs: run .venv/bin/python scripts/gen_dashboards.py"


@pytest.mark.parametrize("path", ph.DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_shape(path: Path) -> None:
    d = json.loads(path.read_text())
    assert d["uid"] == path.stem and d["schemaVersion"] >= 39
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"instance", "model", "engine"} <= variables.keys()
    # "All" engines must match the series of a node's one agent too, which have no engine.
    assert variables["engine"]["allValue"] == ".*"
    assert 'engine=~"$engine"' in variables["instance"]["query"]["query"]
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == ds, p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ds, p["title"]
            expr = t["expr"]
            assert 'instance=~"$instance", engine=~"$engine"' in expr, \
                f"{p['title']}: not filtered by $instance and $engine"
            # Range vectors span $__rate_interval (or the whole range): a fixed [5m] breaks
            # at scrape intervals other than the one it was written for.
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window in ("$__rate_interval", "$__range"), f"{p['title']}: [{window}]"


def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses each dashboard expression, as a recording rule of a scratch file."""
    need_prometheus()
    exprs = [ph.substitute(e) for path in ph.DASHBOARDS for _, e in ph.dashboard_exprs(path)
             if not e.startswith("label_values(")]
    doc = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:expr{n}", "expr": e} for n, e in enumerate(exprs)]}]}
    scratch = tmp_path / "dashboard-exprs.rules.yml"
    scratch.write_text(yaml.safe_dump(doc))
    r = promtool("check", "rules", str(scratch))
    assert r.returncode == 0, r.stdout + r.stderr


def test_metric_name_extraction() -> None:
    names = ph.metric_names(
        'sum by (le) (rate(a_bucket{x="y", z=~"1e3"}[5m] offset 1h)) > 0.5 and on (i) '
        'group_left (j) b or vector(1) unless count without (k) (c:rec) * 1e3 + 0x1f')
    assert names == {"a_bucket", "b", "c:rec"}
    assert ph.metric_names('label_values(pitstop_node_info{model=~"$model"}, instance)') \
        == {"pitstop_node_info"}
    assert ph.exposed_names("# TYPE h histogram\n# TYPE c_total counter\nc_total 1\n") \
        == {"h", "h_bucket", "h_sum", "h_count", "c_total"}


# --- a real agent, a real Prometheus ---------------------------------------------------------
class Live:
    """The module's running pieces: one healthy agent, one that never gets healthy."""

    def __init__(self, prometheus: ph.PrometheusServer, healthy: ph.Agent,
                 broken: ph.Agent) -> None:
        self.prometheus, self.healthy, self.broken = prometheus, healthy, broken


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Live]:
    need_prometheus()
    model = tiny_model
    work = tmp_path_factory.mktemp("obs")
    healthy_cfg = ph.agent_config(work / "healthy", model)
    # The real engine, given too little time to ever answer its health check: every start
    # fails, and after crash_loop_limit failures the agent gives up (state failed).
    broken_cfg = ph.agent_config(
        work / "broken", model, health={"start_timeout_s": 0.3},
        restart={"crash_loop_limit": 2, "backoff_initial_s": 0.2, "backoff_max_s": 0.5})
    with ph.running_agent(work, "healthy", healthy_cfg) as healthy, \
            ph.running_agent(work, "broken", broken_cfg) as broken:
        rules = ph.short_for_rules(ph.RULES, work / "short-for.rules.yml")
        with ph.running_prometheus(work / "prom", [healthy.metrics, broken.metrics],
                                   [rules]) as prom:
            yield Live(prom, healthy, broken)


@pytest.mark.integration
def test_every_metric_used_by_dashboards_and_rules_is_exposed(live: Live) -> None:
    exposed = ph.exposed_names(live.healthy.scrape())
    known = exposed | ph.recorded_names([ph.RULES, *PIN_RULES]) | ph.PROMETHEUS_NAMES
    used = [(where, e) for path in ph.DASHBOARDS for where, e in ph.dashboard_exprs(path)]
    used += [(where, e) for path in [ph.RULES, *PIN_RULES] for where, e in ph.rule_exprs(path)]
    missing = {f"{where}: {name}" for where, e in used for name in ph.metric_names(e)
               if name not in known}
    assert missing == set()
    # And the catalogue is what a running agent serves, no more, no less.
    assert catalogue_names() <= exposed


@pytest.mark.integration
def test_every_expression_evaluates_on_prometheus(live: Live) -> None:
    exprs = [(w, e) for p in ph.DASHBOARDS for w, e in ph.dashboard_exprs(p)
             if not e.startswith("label_values(")]
    exprs += ph.rule_exprs(ph.RULES)
    for where, e in exprs:
        try:
            live.prometheus.query(ph.substitute(e))
        except ValueError as err:
            pytest.fail(f"{where}: {err}")


@pytest.mark.integration
def test_engine_down_alert_fires_for_an_engine_that_cannot_start(live: Live) -> None:
    target = live.broken.metrics

    def firing() -> set[str]:
        return {a["labels"]["alertname"] for a in live.prometheus.alerts()
                if a["state"] == "firing" and a["labels"].get("instance") == target}

    fired = ph.wait_for("PitstopEngineDown and PitstopCrashLoop firing for the broken agent",
                        lambda: {"PitstopEngineDown", "PitstopCrashLoop"} <= firing()
                        and firing(), timeout=90, every=1.0)
    assert {"PitstopEngineDown", "PitstopCrashLoop"} <= fired
    assert live.broken.status()["state"] == "failed"
    # The healthy agent serves: its engine is up in Prometheus, and nothing fires for it.
    ph.wait_for("the healthy agent's engine up in prometheus", lambda: any(
        r["value"][1] == "1" for r in live.prometheus.query(
            f'pitstop_engine_up{{instance="{live.healthy.metrics}"}}')), timeout=120)
    time.sleep(3)  # longer than the shortened `for:`, so a wrong alert would show by now
    assert not {a["labels"]["alertname"] for a in live.prometheus.alerts()
                if a["state"] == "firing"
                and a["labels"].get("instance") == live.healthy.metrics} & \
        {"PitstopEngineDown", "PitstopCrashLoop"}
