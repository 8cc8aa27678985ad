"""The reload policy: every key classified, live keys applied to every part that holds them,
refused keys kept and named; `pitstop reload` against a real agent."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agent.config import Config, parse_config
from agent.errors import ConfigError
from agent.reload import POLICY, changed_keys, config_keys, plan, policy_markdown
from agent.store import Retention
from agent.systemd import Notifier
from tests.agentproc import REPO, RunningAgent, agent_config
from tests.snapshot_helpers import criu

DOCS = REPO / "docs" / "operations.md"


def _config(tmp: Path, model: Path, **sections: dict) -> Config:
    return parse_config(agent_config(tmp, model, **sections), "test")


# --- the table --------------------------------------------------------------------------

def test_every_config_key_is_classified_once_and_nothing_else_is() -> None:
    keys = config_keys()
    assert len(keys) == len(set(keys))
    missing = sorted(set(keys) - set(POLICY))
    assert not missing, f"add these config keys to agent/reload.py POLICY: {missing}"
    assert sorted(set(POLICY) - set(keys)) == [], "POLICY names keys config.py does not have"


def test_the_key_walk_reaches_nested_sections() -> None:
    keys = config_keys()
    assert "front.queue.max_waiting" in keys and "health.canary.prompt" in keys
    assert "vllm.preload.args" in keys and "front.queue" not in keys


def test_the_docs_show_the_policy_table_as_the_code_has_it() -> None:
    assert policy_markdown() in DOCS.read_text(), (
        "docs/operations.md's reload table differs from agent/reload.py POLICY; paste "
        "`python -c 'from agent.reload import policy_markdown; print(policy_markdown())'`")


# --- planning a reload -------------------------------------------------------------------

def test_a_reload_applies_live_keys_and_keeps_the_running_value_of_refused_ones(
        tmp_path: Path) -> None:
    old = _config(tmp_path, tmp_path / "m", snapshots={"keep": 2, "quiet_timeout_s": 30},
                  holder={"dir": str(tmp_path / "h1")})
    new = _config(tmp_path, tmp_path / "m", snapshots={"keep": 5, "quiet_timeout_s": 7},
                  holder={"dir": str(tmp_path / "h2")}, metrics={"port": 9999})
    effective, result = plan(old, new, "pitstop.yaml")
    assert result.applied == ("snapshots.quiet_timeout_s", "snapshots.keep")
    assert [r.key for r in result.refused] == ["metrics.port", "holder.dir"]
    assert not result.engine_restart and not result.error
    assert effective.snapshots.keep == 5 and effective.snapshots.quiet_timeout_s == 7
    assert effective.metrics.port == old.metrics.port
    assert effective.holder.dir == tmp_path / "h1"
    assert changed_keys(old, effective) == ["snapshots.quiet_timeout_s", "snapshots.keep"]
    assert "refused, needs a restart of the agent (systemctl restart pitstop-agent): " \
        "metrics.port, holder.dir" in result.summary()


def test_an_engine_key_asks_for_the_engine_to_be_replaced(tmp_path: Path) -> None:
    old = _config(tmp_path, tmp_path / "m")
    _, result = plan(old, _config(tmp_path, tmp_path / "m", engine={"args": ["--x"]}), "f")
    assert result.applied == ("engine.args",) and result.engine_restart
    _, result = plan(old, _config(tmp_path, tmp_path / "m", engine={"stop_timeout_s": 3}), "f")
    assert result.applied == ("engine.stop_timeout_s",) and not result.engine_restart


def test_a_changed_engine_kind_refuses_the_whole_reload(tmp_path: Path) -> None:
    old = _config(tmp_path, tmp_path / "m")
    new = _config(tmp_path, tmp_path / "m", engine={"kind": "vllm"},
                  health={"interval_s": 5})
    effective, result = plan(old, new, "f")
    assert result.applied == ()
    assert {r.key: r.why for r in result.refused} == {
        "engine.kind": POLICY["engine.kind"][1], "health.interval_s": "engine.kind changed too"}
    assert effective == old


def test_applied_keys_that_contradict_a_refused_one_refuse_everything(tmp_path: Path) -> None:
    # vllm.preload.enabled (refused) stays on, and engine.args now holds a flag it forbids.
    common = dict(engine={"kind": "vllm", "args": []}, vllm={"preload": {"enabled": True}})
    old = _config(tmp_path, tmp_path / "m", **common)
    new = _config(tmp_path, tmp_path / "m", engine={"kind": "vllm",
                                                   "args": ["--enable-sleep-mode"]})
    with pytest.raises(ConfigError, match=r"do not fit the running values of those that need "
                       r"a restart \(vllm.preload.enabled\)"):
        plan(old, new, "f")


def test_keys_and_certificates_apply_live_but_turning_tls_on_or_off_waits_for_a_restart(
        tmp_path: Path) -> None:
    tls = {"cert_file": str(tmp_path / "a.crt"), "key_file": str(tmp_path / "a.key")}
    plain = _config(tmp_path, tmp_path / "m")
    secured = _config(tmp_path, tmp_path / "m", front={"tls": tls,
                                                      "api_key_file": str(tmp_path / "k")},
                      metrics={"web_config_file": str(tmp_path / "web.yml")})
    effective, result = plan(plain, secured, "f")
    assert result.applied == ("front.api_key_file",)
    assert {r.key: r.why for r in result.refused} == {
        "front.tls.cert_file": "TLS on the front is turned on or off only at start",
        "front.tls.key_file": "TLS on the front is turned on or off only at start",
        "metrics.web_config_file": "the metrics endpoint's web configuration is taken up or "
                                   "dropped only at start"}
    assert effective.front.tls == plain.front.tls and effective.front.api_key_file
    _, result = plan(secured, plain, "f")
    assert result.applied == ("front.api_key_file",) and len(result.refused) == 3
    # Other files in the same roles: new handshakes use them.
    moved = _config(tmp_path, tmp_path / "m", front={"tls": {
        "cert_file": str(tmp_path / "b.crt"), "key_file": str(tmp_path / "b.key")}},
        metrics={"web_config_file": str(tmp_path / "web2.yml")})
    _, result = plan(secured, moved, "f")
    assert result.applied == ("front.api_key_file", "front.tls.cert_file",
                              "front.tls.key_file", "metrics.web_config_file")
    assert result.refused == ()


def test_nothing_changed_says_so(tmp_path: Path) -> None:
    cfg = _config(tmp_path, tmp_path / "m")
    effective, result = plan(cfg, cfg, "f")
    assert effective == cfg and result.summary() == "configuration reloaded from f: nothing " \
        "changed"


# --- applying: every part that holds a value gets the new one ------------------------------

def test_every_part_of_the_agent_takes_the_live_values(tmp_path: Path, tiny_model: Path) -> None:
    criu()
    from agent.wiring import Agent

    old = _config(tmp_path, tiny_model, holder={"enabled": False})
    agent = Agent.start(old, None, Notifier({}))
    assert agent.snapshotter is not None and agent.capture is not None
    new = _config(
        tmp_path, tiny_model, holder={"enabled": True},
        snapshots={"keep": 7, "disk_budget_gib": 3, "quiet_timeout_s": 4, "verify": "always",
                   "cuda_lock_timeout_ms": 55, "drift_check_interval_s": 0,
                   "regenerate": "manual", "quarantine_keep": 0, "restore_log_level": 4},
        health={"timeout_s": 0.5, "interval_s": 0.25},
        front={"queue": {"max_waiting": 3}, "max_resumes": 9},
        restart={"crash_loop_limit": 9}, engine={"stop_timeout_s": 2})
    effective, result = plan(old, new, "f")
    assert not result.refused
    agent.reconfigure(effective, result)
    assert agent.config == agent.supervisor.config == agent.reader.config == effective
    assert agent.capture.quiet_timeout_s == 4
    assert agent.store.retention.keep == 7 and agent.store.retention.budget_bytes == 3 * 2**30
    assert agent.snapshotter.store.trust_sealed is False
    # The store's retention, which every backend publishing into it is pruned by.
    assert agent.store is agent.snapshotter.store
    assert agent.store.retention == Retention(keep=7, budget_bytes=3 * 2**30, quarantine_keep=0)
    assert agent.snapshotter.cuda.lock_timeout_ms == 55
    assert agent.snapshotter.criu.restore_verbosity == 4
    assert agent.full.timeout_s == agent.hybrid.timeout_s == 5.0
    assert agent.holder.config.enabled
    assert agent.front is not None and agent.front.config == effective.front
    assert agent.supervisor.backoff_delay() == (0.0, 0)  # the reload cleared the failures


# --- `pitstop reload` against a real agent ---------------------------------------------------

def _pitstop(agent: RunningAgent, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args, "--config",
                           str(agent.config_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def _pitstop_status(agent: RunningAgent) -> str:
    # The status command reads the file only for paths.run: give it the one that started.
    agent.write_config(agent.config)
    return _pitstop(agent, "status").stdout


def _snapshot_ids(agent: RunningAgent) -> list[str]:
    r = _pitstop(agent, "snapshot", "list", "--json")
    assert r.returncode == 0, r.stderr
    return [e["id"] for e in json.loads(r.stdout)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_pitstop_reload_reports_applied_and_refused_keys_and_the_next_capture_uses_them(
        tmp_path: Path, tiny_model: Path) -> None:
    criu()
    cfg = agent_config(tmp_path, tiny_model, snapshots={"keep": 3, "quiet_timeout_s": 30})
    a = RunningAgent(tmp_path, cfg)
    try:
        a.wait_ready()
        a.wait_for(lambda s: s["state"] == "ready" and "published" in s.get("reason", ""),
                   120, "the first snapshot")
        for _ in range(2):
            r = _pitstop(a, "snapshot", "create")
            assert r.returncode == 0, r.stderr
        assert len(_snapshot_ids(a)) == 3
        st = a.status()
        pid, metrics = st["engine_pid"], st["metrics"]
        cfg["snapshots"].update(keep=1, quiet_timeout_s=7)
        cfg["metrics"]["port"] = _free_port()
        cfg["holder"] = {"dir": str(tmp_path / "elsewhere")}
        a.write_config(cfg)

        r = _pitstop(a, "reload", "--json")
        assert r.returncode == 1 and r.stdout, r.stderr  # keys were refused
        report = json.loads(r.stdout)
        assert report["applied"] == ["snapshots.quiet_timeout_s", "snapshots.keep"]
        assert [x["key"] for x in report["refused"]] == ["metrics.port", "holder.dir"]
        assert report["error"] == "" and not report["engine_restart"]
        assert "reload: metrics.port keeps its running value" in a.log()
        text = _pitstop(a, "status").stdout
        assert "refused, needs a restart of the agent: holder.dir" in text, text
        assert a.status()["last_reload"] == report

        # Refused: the endpoint the agent started with still serves, on its old port.
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as m:
            assert b"pitstop_engine_up 1.0" in m.read()
        # Applied: the next capture waits with the new limit, and its prune keeps one.
        r = _pitstop(a, "snapshot", "create", "--json")
        assert r.returncode == 0, r.stderr
        assert "waiting up to 7s for 0 requests in flight" in a.log()
        assert _snapshot_ids(a) == [json.loads(r.stdout)["id"]]
        assert a.status()["engine_pid"] == pid  # nothing was restarted
    finally:
        a.stop()


@pytest.mark.integration
def test_pitstop_reload_of_a_broken_file_changes_nothing_and_says_why(
        tmp_path: Path, tiny_model: Path) -> None:
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model, snapshots={"enabled": False}))
    try:
        a.wait_ready()
        pid = a.status()["engine_pid"]
        a.config_path.write_text("engine: {kind: reference, model: /m, typo: 1}\n")
        # The command reads the file too (to find the agent): it says what is wrong, exit 2.
        r = _pitstop(a, "reload")
        assert r.returncode == 2 and "engine.typo: unknown key" in r.stderr, r.stderr
        a.proc.send_signal(signal.SIGHUP)
        st = a.wait_for(lambda s: s.get("last_reload"), 30, "the reload report")
        assert st["last_reload"]["applied"] == [] and st["last_reload"]["refused"] == []
        assert st["last_reload"]["error"].startswith(f"{a.config_path}: invalid configuration")
        assert "reload refused, the running configuration is kept" in _pitstop_status(a)
        assert st["state"] == "ready" and st["engine_pid"] == pid
    finally:
        a.stop()
