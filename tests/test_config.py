"""The configuration file: good files load, bad ones are refused naming file and key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import load_config, parse_text
from agent.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_the_embedded_default_is_the_reference_engine_on_localhost():
    cfg = load_config(None)
    assert cfg.engine.kind == "reference"
    assert (cfg.front.host, cfg.front.port) == ("127.0.0.1", 8000)
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 9410)
    assert "~" not in str(cfg.engine.model)


def test_the_annotated_example_is_valid():
    cfg = load_config(REPO / "examples" / "pitstop.yaml")
    assert cfg.engine.kind in ("reference", "vllm")


def test_engine_socket_defaults_to_the_run_directory(tmp_path):
    cfg = parse_text(f"engine: {{model: /m}}\npaths: {{state_dir: {tmp_path}}}\n", "t.yaml")
    assert cfg.engine_socket == tmp_path / "run" / "engine.sock"
    assert cfg.paths.snapshots == tmp_path / "snapshots"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("engine: {model: /m}\nfront: {prot: 1}\n", ["front.prot", "unknown key"]),
        ("engine: {model: /m}\nsnapshots: {lazy_restore: true}\n",
         ["snapshots.lazy_restore", "no longer a key", "slower", "remove it"]),
        ("front: {port: 80}\n", ["engine", "required key is missing"]),
        ("engine: {model: /m, kind: tgi}\n", ["engine.kind", "'reference' or 'vllm'"]),
        ("engine: {model: /m}\nhealth: {interval_s: soon}\n", ["health.interval_s", "number"]),
        ("engine: {model: /m}\nfront: {port: 70000}\n", ["front.port", "65535"]),
        ("engine: {model: /m}\nrestart: {backoff_initial_s: 9, backoff_max_s: 1}\n",
         ["restart", "backoff_initial_s must not exceed backoff_max_s"]),
        ("- just\n- a list\n", ["expected a mapping"]),
        ("engine: {model: [unclosed\n", ["not valid YAML"]),
    ],
)
def test_a_bad_file_names_the_file_and_the_key(text, names):
    with pytest.raises(ConfigError) as err:
        parse_text(text, "/etc/pitstop/pitstop.yaml")
    msg = str(err.value)
    assert msg.startswith("/etc/pitstop/pitstop.yaml: ")
    for name in names:
        assert name in msg


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def _check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "check-config", str(path)],
                          capture_output=True, text=True, cwd=REPO)


def test_check_config_exits_0_on_a_good_file():
    r = _check_config(REPO / "examples" / "pitstop.yaml")
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_check_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "pitstop.yaml"
    bad.write_text("engine:\n  model: /m\n  kind: reference\n  sokcet: /x\n")
    r = _check_config(bad)
    assert r.returncode == 2
    assert str(bad) in r.stderr and "engine.sokcet" in r.stderr


@pytest.mark.parametrize("engine, names", [
    ("args: [--api-key, sk-secret-value]", "engine.args[0]: an API key on the engine"),
    ("args: [--port-x, '1', --api-key=sk-secret-value]", "engine.args[2]: an API key"),
    ("env: {VLLM_API_KEY: sk-secret-value}", "engine.env.VLLM_API_KEY: an API key"),
])
def test_an_engine_key_is_refused_with_the_way_to_do_it_and_never_printed(engine, names):
    with pytest.raises(ConfigError) as e:
        parse_text(f"engine: {{model: /m, {engine}}}", "f.yaml")
    assert names in str(e.value)
    assert "front.api_key_file" in str(e.value) and "PITSTOP_API_KEY" in str(e.value)
    assert "sk-secret-value" not in str(e.value)


@pytest.mark.parametrize("tls, says", [
    ("{cert_file: /c}", "front.tls.cert_file and front.tls.key_file go together"),
    ("{key_file: /k}", "front.tls.cert_file and front.tls.key_file go together"),
    ("{client_ca_file: /ca}", "front.tls.client_ca_file needs front.tls.cert_file"),
])
def test_half_a_tls_setting_is_refused(tls, says):
    with pytest.raises(ConfigError, match=says):
        parse_text(f"engine: {{model: /m}}\nfront: {{tls: {tls}}}", "f.yaml")
