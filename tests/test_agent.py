"""The agent end to end: the real reference engine on CPU, supervised, behind the front."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from tests.agentproc import REPO, RunningAgent, agent_config

pytestmark = pytest.mark.integration


@pytest.fixture
def agent(tmp_path, tiny_model):
    # Snapshots off: these tests pin the supervisor and the cold rung; the restore rungs
    # have tests of their own.
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model,
                                            snapshots={"enabled": False}))
    a.wait_ready()
    yield a
    a.stop()


def _client(agent: RunningAgent) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.front_url, api_key="unused", max_retries=0,
                         timeout=60)


def _greedy(client: openai.OpenAI, model: str, prompt: str = "Once upon a time") -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    return r.choices[0].text


def test_the_front_serves_completions_and_chat_to_the_openai_client(agent):
    client = _client(agent)
    model = client.models.list().data[0].id
    text = _greedy(client, model)
    assert text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True))
    assert streamed == text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat.choices[0].message.content


def test_a_killed_engine_comes_back_and_serves_the_same_answers(agent):
    client = _client(agent)
    model = client.models.list().data[0].id
    before = _greedy(client, model)
    os.kill(agent.status()["engine_pid"], signal.SIGKILL)
    st = agent.wait_recovered(1)
    assert st["last_recovery"]["cause"] == "crash"
    assert st["last_recovery"]["path"] == "cold"
    assert _greedy(client, model) == before
    assert "killed by SIGKILL" in agent.log()


def test_a_stopped_engine_is_detected_as_hung_and_replaced(agent):
    old = agent.status()["engine_pid"]
    os.kill(old, signal.SIGSTOP)
    st = agent.wait_recovered(1, timeout=90)
    assert st["last_recovery"]["cause"] == "hang"
    assert "failed 3 health checks in a row" in agent.log()
    assert f"engine failed (hang): engine {old} failed 3 health checks" in agent.log()


def test_status_reports_state_pid_uptime_and_last_recovery(agent):
    env = {**os.environ}
    r = subprocess.run([sys.executable, "-m", "agent", "status", "--config",
                        str(agent.config_path)], capture_output=True, text=True, cwd=REPO,
                       env=env)
    assert r.returncode == 0, r.stderr
    pid = agent.status()["engine_pid"]
    assert "state:    ready" in r.stdout
    assert f"pid {pid}" in r.stdout
    assert "uptime:" in r.stdout
    assert "last recovery: cold (startup) success" in r.stdout
    j = subprocess.run([sys.executable, "-m", "agent", "status", "--json", "--config",
                        str(agent.config_path)], capture_output=True, text=True, cwd=REPO)
    import json

    data = json.loads(j.stdout)
    assert data["state"] == "ready" and data["engine_pid"] == pid


def test_metrics_report_engine_up_and_the_recovery(agent):
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        text = r.read().decode()
    assert "pitstop_engine_up 1.0" in text
    assert 'pitstop_engine_state{state="ready"} 1.0' in text
    assert 'pitstop_recoveries_total{cause="startup",path="cold",result="success"} 1.0' in text
    assert "pitstop_recovery_duration_seconds_bucket" in text
    assert 'pitstop_build_info{version="' in text


def test_sigterm_stops_the_engine_and_exits_cleanly(tmp_path, tiny_model):
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model))
    pid = a.wait_ready()["engine_pid"]
    assert a.stop() == 0
    assert not os.path.exists(f"/proc/{pid}")
    assert "state stopping -> stopped" in a.log()
    assert a.status()["state"] == "stopped"


def test_a_bad_config_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text("engine:\n  model: /m\nhealth:\n  intervall_s: 1\n")
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(cfg)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert "health.intervall_s" in r.stderr and str(cfg) in r.stderr


def test_a_missing_model_says_how_to_make_one(tmp_path):
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text(f"engine:\n  model: {tmp_path}/none\npaths:\n  state_dir: {tmp_path}/s\n")
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(cfg)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 1
    assert "pitstop make-model" in r.stderr


def test_an_engine_that_keeps_dying_ends_in_a_crash_loop_and_a_reload_clears_it(
        tmp_path, tiny_model):
    cfg = agent_config(tmp_path, tiny_model,
                       engine={"args": ["--no-such-flag"]},
                       restart={"crash_loop_limit": 2, "crash_loop_window_s": 60,
                                "backoff_initial_s": 0.1, "backoff_max_s": 0.2})
    a = RunningAgent(tmp_path, cfg)
    try:
        st = a.wait_for(lambda s: s.get("state") == "failed", 120, "crash loop")
        assert "crash loop" in st["reason"]
        cfg["engine"]["args"] = []
        a.write_config(cfg)
        a.proc.send_signal(signal.SIGHUP)
        st = a.wait_ready()
        assert st["last_recovery"]["cause"] == "reload" or \
            st["last_recovery"]["cause"] == "reset"
    finally:
        a.stop()


def test_a_reload_with_a_broken_config_keeps_the_running_one(agent):
    pid = agent.status()["engine_pid"]
    agent.config_path.write_text("engine: [broken\n")
    agent.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reload refused" not in agent.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "reload refused, keeping the running configuration" in agent.log()
    assert agent.status()["state"] == "ready" and agent.status()["engine_pid"] == pid
