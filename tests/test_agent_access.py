"""A real `pitstop run` with API keys (a file and PITSTOP_API_KEY), TLS at the front and
TLS with basic auth at /metrics: the openai client and a real Prometheus work with their
ordinary settings, a stream with a key survives a SIGKILL of the engine, a reload adds and
revokes keys and renews certificates while a stream runs, and no secret reaches the log."""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import openai
import pytest
import yaml

from agent.status_text import format_status
from tests.agentproc import REPO, RunningAgent, agent_config
from tests.prereq import require
from tests.promharness import have_prometheus, running_prometheus, wait_for
from tests.tlskit import Issued, TestCA

pytestmark = pytest.mark.integration

KEY_A = "sk-access-first-key-0123456789"
KEY_B = "sk-access-second-key-9876543210"
ENV_KEY = "sk-access-from-the-environment-5555"
PASSWORD = "prometheus-scrape-password-1"
NEW_PASSWORD = "prometheus-scrape-password-2"
SECRETS = (KEY_A, KEY_B, ENV_KEY, PASSWORD, NEW_PASSWORD)
PROMPT = "Once upon a time there was a node agent"
MAX_TOKENS = 48


@dataclass
class Node:
    """The agent and the files an operator would have written for it."""

    agent: RunningAgent
    ca: TestCA
    files: Path

    def client(self, key: str, ca: Path | None = None) -> openai.OpenAI:
        ctx = ssl.create_default_context(cafile=ca or self.ca.cert)
        return openai.OpenAI(base_url=self.agent.front_url, api_key=key, max_retries=0,
                             timeout=120, http_client=openai.DefaultHttpxClient(verify=ctx))


def _write_private(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def _install(cert: Issued, files: Path, name: str) -> None:
    """A certificate and key put where the configuration names them, as the role does."""
    (files / f"{name}.crt").write_bytes(cert.cert.read_bytes())
    _write_private(files / f"{name}.key", cert.key.read_text())


def _web_config(files: Path, user: str, password: str) -> None:
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    (files / "web-config.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": "metrics.crt", "key_file": "metrics.key"},
        "basic_auth_users": {user: hashed}}))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("access")
    files = tmp / "etc"
    files.mkdir()
    ca = TestCA(tmp / "ca", "pitstop access test CA")
    _install(ca.issue("front", server=True), files, "front")
    _install(ca.issue("metrics", server=True), files, "metrics")
    _write_private(files / "api-keys", f"# the test's keys\n{KEY_A}\n")
    _web_config(files, "prometheus", PASSWORD)
    config = agent_config(
        tmp, tiny_model,
        front={"api_key_file": str(files / "api-keys"),
               "tls": {"cert_file": str(files / "front.crt"),
                       "key_file": str(files / "front.key")}},
        metrics={"web_config_file": str(files / "web-config.yml")},
        # A recovery is a cold start: what is tested here is the front, not the ladder.
        snapshots={"enabled": False},
        # The reload test pauses the engine for a moment; a hang takes longer to count.
        health={"interval_s": 1.0, "failures_before_restart": 5})
    agent = RunningAgent(tmp, config, env={"PITSTOP_API_KEY": ENV_KEY})
    try:
        agent.wait_ready()
        yield Node(agent, ca, files)
    finally:
        agent.stop()


def _reference(node: Node) -> str:
    with node.client(KEY_A) as c:
        return c.completions.create(model=node.agent.status_model(), prompt=PROMPT,
                                    max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text


def _stream(c: openai.OpenAI, node: Node) -> Iterator[str]:
    for chunk in c.completions.create(model=node.agent.status_model(), prompt=PROMPT,
                                      max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}):
        if chunk.choices:
            yield chunk.choices[0].text


def _plain_status(url: str, headers: dict[str, str], ca: Path) -> int:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60,
                                    context=ssl.create_default_context(cafile=ca)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_openai_client_with_its_api_key_through_tls(node: Node) -> None:
    st = node.agent.status()
    assert node.agent.front_url.startswith("https://")
    assert st["front_access"] == {"tls": True, "client_certificates": False, "credentials": 2}
    assert st["metrics_access"] == {"tls": True, "client_certificates": False,
                                    "credentials": 1}
    lines = format_status(st).splitlines()
    assert f"front:    https://{st['front']}/v1 (2 API keys)" in lines
    assert f"metrics:  https://{st['metrics']}/metrics (1 basic-auth user)" in lines
    for key in (KEY_A, ENV_KEY):
        with node.client(key) as c:
            assert "".join(_stream(c, node)) == _reference(node)
            reply = c.chat.completions.create(
                model=node.agent.status_model(), max_tokens=4,
                messages=[{"role": "user", "content": "hello"}])
            assert reply.choices[0].message.content is not None
    with node.client("sk-wrong") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()
    url = node.agent.front_url + "/models"
    assert _plain_status(url, {}, node.ca.cert) == 401
    assert _plain_status(url, {"Authorization": f"Bearer {KEY_A}"}, node.ca.cert) == 200
    # The key of the front is no password of the metrics endpoint.
    assert _plain_status(node.agent.metrics_url, {"Authorization": f"Bearer {KEY_A}"},
                         node.ca.cert) == 401


def test_a_stream_with_the_key_is_resumed_across_a_sigkill_of_the_engine(node: Node) -> None:
    want = _reference(node)
    restarts = node.agent.status()["restarts"]
    got = []
    with node.client(KEY_A) as c:
        for i, piece in enumerate(_stream(c, node)):
            got.append(piece)
            if i == 8:
                os.kill(node.agent.status()["engine_pid"], signal.SIGKILL)
    node.agent.wait_recovered(restarts + 1)
    assert "".join(got) == want
    assert "resumed on recovery" in node.agent.log()


def test_prometheus_scrapes_the_metrics_endpoint_with_tls_and_basic_auth(
        node: Node, tmp_path: Path) -> None:
    require(have_prometheus(), "no Prometheus server: run `make prometheus`")
    (tmp_path / "password").write_text(PASSWORD)
    (tmp_path / "wrong").write_text("not-the-password")
    target = {"targets": [node.agent.status()["metrics"]]}

    def job(name: str, password_file: Path) -> dict:
        # A scrape config as Prometheus's documentation writes one: nothing Pitstop's own.
        return {"job_name": name, "scheme": "https", "static_configs": [target],
                "tls_config": {"ca_file": str(node.ca.cert)},
                "basic_auth": {"username": "prometheus", "password_file": str(password_file)}}

    plain = {"job_name": "no-auth", "scheme": "https", "static_configs": [target],
             "tls_config": {"ca_file": str(node.ca.cert)}}
    with running_prometheus(tmp_path / "prom", [], [], scrape_configs=[
            job("pitstop", tmp_path / "password"), job("wrong", tmp_path / "wrong"), plain]) \
            as prom:
        def up() -> dict[str, str]:
            got = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
            return got if len(got) == 3 else {}

        assert wait_for("three scrapes", up, 60) == {"pitstop": "1", "wrong": "0",
                                                      "no-auth": "0"}
        assert prom.query('pitstop_engine_up{job="pitstop"}')[0]["value"][1] == "1"
        errors = {t["labels"]["job"]: t["lastError"]
                  for t in prom.api("targets")["activeTargets"]}
        assert "401" in errors["wrong"] and "401" in errors["no-auth"], errors


def _reload(node: Node) -> dict:
    r = subprocess.run([sys.executable, "-m", "agent", "reload", "--json", "--config",
                        str(node.agent.config_path)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_a_reload_adds_and_revokes_keys_and_renews_certificates_while_a_stream_runs(
        node: Node) -> None:
    want = _reference(node)
    new_ca = TestCA(node.files.parent / "ca-2", "pitstop access test CA, renewed")
    engine = node.agent.status()["engine_pid"]
    got: list[str] = []
    with node.client(KEY_A) as c:
        stream = _stream(c, node)
        got += [next(stream) for _ in range(3)]
        # The engine paused mid-answer: the stream is open for all that follows, and what
        # the front answers now it answers by itself.
        os.kill(engine, signal.SIGSTOP)
        try:
            _write_private(node.files / "api-keys", f"{KEY_B}\n")
            _install(new_ca.issue("front", server=True), node.files, "front")
            _install(new_ca.issue("metrics", server=True), node.files, "metrics")
            _web_config(node.files, "prometheus", NEW_PASSWORD)
            result = _reload(node)
            assert result["error"] == "" and result["refused"] == []
            with node.client(KEY_A, new_ca.cert) as revoked, \
                    pytest.raises(openai.AuthenticationError):
                revoked.models.list()
            # New handshakes get the new certificate: the old CA no longer verifies it.
            with node.client(KEY_B) as old_ca, pytest.raises(openai.APIConnectionError):
                old_ca.models.list()
            added: list[int] = []
            asking = threading.Thread(target=lambda: added.append(_plain_status(
                node.agent.front_url + "/models", {"Authorization": f"Bearer {KEY_B}"},
                new_ca.cert)))
            asking.start()
        finally:
            os.kill(engine, signal.SIGCONT)
        asking.join(120)
        assert added == [200]
        got += list(stream)
    assert "".join(got) == want
    assert node.agent.status()["front_access"]["credentials"] == 2  # KEY_B and the variable
    metrics = node.agent.metrics_url
    auth = "Basic " + base64.b64encode(b"prometheus:" + NEW_PASSWORD.encode()) \
        .decode()
    assert _plain_status(metrics, {"Authorization": auth}, new_ca.cert) == 200
    old = "Basic " + base64.b64encode(b"prometheus:" + PASSWORD.encode()).decode()
    assert _plain_status(metrics, {"Authorization": old}, new_ca.cert) == 401


def test_a_reload_with_an_unsafe_key_file_keeps_the_keys_in_effect(node: Node) -> None:
    keys = node.files / "api-keys"
    keys.chmod(0o644)
    try:
        r = subprocess.run([sys.executable, "-m", "agent", "reload", "--json", "--config",
                            str(node.agent.config_path)], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
    finally:
        keys.chmod(0o600)
    result = json.loads(r.stdout)
    assert r.returncode == 1 and "mode 0644 lets others read" in result["error"], r.stdout
    url = node.agent.front_url + "/models"
    assert _plain_status(url, {"Authorization": f"Bearer {KEY_B}"},
                         node.files.parent / "ca-2" / "ca.crt") == 200


def test_an_unsafe_key_file_stops_the_agent_at_start(tmp_path: Path, tiny_model: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(KEY_A + "\n")
    keys.chmod(0o640)
    agent = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model,
                                                front={"api_key_file": str(keys)}))
    assert agent.proc.wait(60) == 2
    assert f"front.api_key_file: {keys}: mode 0640 lets others read or run the keys; " \
        f"chmod 600 {keys}" in agent.log()
    assert KEY_A not in agent.log()
    agent.stop()


def test_no_key_or_password_is_in_the_log_the_status_or_the_engine_s_environment(
        node: Node) -> None:
    log = node.agent.log()
    assert "front listening on" in log and "API keys from PITSTOP_API_KEY and" in log
    status = node.agent.status_path.read_text()
    engine = node.agent.status()["engine_pid"]
    environ = Path(f"/proc/{engine}/environ").read_bytes()
    assert b"PITSTOP_API_KEY" not in environ
    for secret in SECRETS:
        assert secret not in log, f"a secret is in the agent's log: {secret[:8]}..."
        assert secret not in status
        assert secret.encode() not in environ
