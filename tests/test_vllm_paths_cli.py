"""vLLM's own paths against the real vLLM (CPU build): Pitstop's command lines parsed by vLLM's
own parsers, and `vllm snapshot` / `vllm preload` run here, their failures mapped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.checkpoint.backend import CreateRequest, take
from agent.engines.vllm.adapter import VllmAdapter
from agent.engines.vllm.preload import daemon_argv, engine_args, run_daemon
from agent.engines.vllm.snapshot import VllmSnapshotBackend
from agent.errors import ConfigError, VllmSnapshotError
from agent.store import Manifest, ProcessTree, SnapshotStore
from tests.snapshot_helpers import CANARY, IDENT, T0, criu
from tests.vllm_paths_kit import REVISION, vllm_config, vllm_parse, vllm_python

ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "512", "--dtype=float32",
               "--gpu-memory-utilization", "0.1"]


@pytest.fixture(scope="module")
def py() -> Path:
    return vllm_python()


def _config(tmp: Path, py: Path, model: Path | None = None):
    return vllm_config(tmp, model, python=py, engine={"args": ENGINE_ARGS},
                       vllm={"snapshot": {"model": "Qwen/Qwen3-0.6B", "revision": REVISION},
                             "preload": {"enabled": True, "args": ["--seed", "3"]}})


def _tail(argv: list[str], n: int) -> list[str]:
    return argv[n:]  # drop [python, -m, module] or [python, -c, SHIM]


def test_every_command_line_parses_with_the_real_vllm(tmp_path: Path, py: Path) -> None:
    cfg = _config(tmp_path, py)
    backend = VllmSnapshotBackend.from_config(cfg, python=str(py))
    snap = tmp_path / "state" / "snapshots" / "20261129T000000Z-vllm-abcdef" / "vllm"
    serve = _tail(VllmAdapter(cfg).launch_spec().argv, 3) + engine_args(cfg)
    cases = [
        {"kind": "serve", "argv": serve, "want": ["load_format", "model_loader_extra_config",
                                                   "uds", "enforce_eager"]},
        {"kind": "cli", "argv": _tail(daemon_argv(cfg, str(py), 1), 3),
         "want": ["model", "dtype", "max_model_len", "enforce_eager", "seed",
                  "weight_cache_socket_dir", "weight_cache_health_host",
                  "weight_cache_health_port", "gpu_memory_utilization"]},
        {"kind": "cli", "argv": _tail(backend.argv("create", snap), 3), "child": True,
         "want": ["revision", "snapshot_dir", "served_model_name", "model_tag"]},
        {"kind": "cli", "argv": _tail(backend.argv("inspect", snap), 3), "want": ["snapshot_dir"]},
        {"kind": "cli", "argv": _tail(backend.argv("restore", snap), 3),
         "want": ["snapshot_dir", "host", "port"]},
        # The harness does catch mistakes: a misspelt flag, a local model for create.
        {"kind": "cli", "argv": ["preload", "--model", "/m", "--weight-cache-health-prot", "1"]},
        {"kind": "cli", "argv": ["snapshot", "create", str(tmp_path), "--revision", REVISION,
                                 "--snapshot-dir", str(snap)]},
    ]
    serve_r, preload_r, create_r, inspect_r, restore_r, typo_r, local_r = vllm_parse(py, cases)
    for r in (serve_r, preload_r, create_r, inspect_r, restore_r):
        assert r["ok"], r
    assert serve_r["args"] == {
        "load_format": "ipc_cache", "uds": str(cfg.engine_socket), "enforce_eager": True,
        "model_loader_extra_config": {"socket_dir": "/run/pitstop/vllm-preload",
                                      "fallback": False}}
    # The daemon gets the engine's weight-defining flags, not its memory share.
    assert preload_r["args"] == {
        "model": str(cfg.engine.model), "dtype": "float32", "max_model_len": 512,
        "enforce_eager": True, "seed": 3, "weight_cache_socket_dir": "/run/pitstop/vllm-preload",
        "weight_cache_health_host": "127.0.0.1", "weight_cache_health_port": 8471,
        "gpu_memory_utilization": 0.92}
    child = create_r["args"].pop("child")
    assert create_r["args"] == {"model_tag": "Qwen/Qwen3-0.6B", "revision": REVISION,
                                "snapshot_dir": str(snap), "served_model_name": ["tiny"]}
    # What vLLM records as the snapshot's engine argv is what the rung expects to find.
    assert tuple(child) == backend.expected_argv()
    assert restore_r["args"] == {"snapshot_dir": str(snap), "host": "127.0.0.1", "port": 8001}
    assert inspect_r["args"] == {"snapshot_dir": str(snap)}
    assert not typo_r["ok"] and "--weight-cache-health-prot" in typo_r["error"]
    assert not local_r["ok"] and "immutable remote model" in local_r["error"]


def test_real_vllm_snapshot_failures_on_this_cpu_host_map_to_pitstop_errors(
        tmp_path: Path, py: Path) -> None:
    criu_path = criu().path
    backend = VllmSnapshotBackend.from_config(_config(tmp_path, py), python=str(py), criu=criu_path)

    with pytest.raises(VllmSnapshotError) as missing:
        backend.read(tmp_path / "absent")
    assert missing.value.code == "not_found"
    assert f"snapshot path does not exist: {tmp_path / 'absent'}" in str(missing.value)

    broken = tmp_path / "snap" / "vllm"
    broken.mkdir(mode=0o700, parents=True)
    (broken / "manifest.json").write_text("{}")
    os.chmod(broken / "manifest.json", 0o600)
    with pytest.raises(VllmSnapshotError) as corrupt:
        backend.read(broken)
    assert corrupt.value.code == "corrupt"
    assert "invalid snapshot manifest" in str(corrupt.value) and "delete" in str(corrupt.value)

    # CRIU is on vLLM's PATH (Pitstop put its directory first): what this host lacks is CUDA.
    with pytest.raises(VllmSnapshotError) as restore:
        backend.restore(_manifest_stub(), broken.parent)
    assert restore.value.code == "no_cuda", restore.value
    assert "`cuda-checkpoint` is not on PATH" in str(restore.value)
    assert "NVIDIA GPU" in str(restore.value)

    store = SnapshotStore(tmp_path / "state" / "snapshots")
    with pytest.raises(VllmSnapshotError) as create:
        take(store, backend, CreateRequest("vllm"), IDENT)
    assert create.value.code == "no_cuda", create.value
    # vLLM checks before it makes the directory, the store removes its draft: nothing
    # half-made is left.
    assert store.ids() == [] and os.listdir(store.root) == []


def _manifest_stub() -> Manifest:
    return Manifest(id="20261129T000000Z-vllm-abcdef", kind="vllm", created_at=T0,
                    identity=IDENT, process=ProcessTree(root_pid=1, pids=(1,)), chunk_bytes=1,
                    files=(), timings={}, canary=CANARY)


def test_vllm_preload_on_this_cpu_host_exits_with_vllms_reason(
        tmp_path: Path, py: Path, tiny_model: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, py, tiny_model)
    cfg = cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={
        "preload": cfg.vllm.preload.model_copy(update={"socket_dir": tmp_path / "sockets"})})})
    rc = run_daemon(cfg, str(py), "0", poll_s=0.2)
    out = capfd.readouterr()
    assert rc != 0
    assert "does not support CUDA IPC weight sharing" in out.out + out.err
    assert (tmp_path / "sockets").stat().st_mode & 0o777 == 0o700


def test_the_cli_reports_a_missing_vllm_snapshot(tmp_path: Path, py: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text(json.dumps({
        "engine": {"kind": "vllm", "model": str(tmp_path / "m"), "python": str(py)},
        "paths": {"state_dir": str(tmp_path / "state")},
        "vllm": {"snapshot": {"model": "Qwen/Qwen3-0.6B", "revision": REVISION}}}))
    assert main(["vllm-snapshot", "list", "--config", str(cfg)]) == 0
    assert "no vLLM snapshots" in capsys.readouterr().out
    assert main(["vllm-snapshot", "inspect", "20261129T000000Z-vllm", "--config", str(cfg)]) == 1
    assert "snapshot path does not exist" in capsys.readouterr().err


def test_the_adapter_refuses_the_max_model_len_that_vllm_refuses(
        tmp_path: Path, py: Path, tiny_model: Path) -> None:
    # make-model's config.json says max_position_embeddings 2048; vLLM decides from it.
    lengths = ["2048", "2k", "4096", "3K"]
    cases = [{"kind": "model", "argv": ["--model", str(tiny_model), "--max-model-len", n,
                                        "--enforce-eager"], "want": ["max_model_len"]}
             for n in lengths]
    verdicts = vllm_parse(py, cases)
    for n, vllm in zip(lengths, verdicts, strict=True):
        cfg = vllm_config(tmp_path, tiny_model, python=py,
                          engine={"args": ["--max-model-len", n]})
        try:
            VllmAdapter(cfg)
            ours = True
        except ConfigError:
            ours = False
        assert ours == vllm["ok"], (n, vllm)
    assert [v["ok"] for v in verdicts] == [True, True, False, False]
    assert "max_position_embeddings=2048" in verdicts[2]["error"]


# In vLLM's interpreter: a tree as CRIU leaves it after a dump, every process SIGKILLed
# and nobody waited for yet. The root is the command's own child; its child (the engine
# core) is then an orphan of this process (a subreaper in both runs, so that no init
# reaps it first), a zombie until it is reaped, as it is a live process while it still
# gives its GPU memory back: vLLM's own check fails on it either way.
_DUMPED_TREE = """
import ctypes, json, os, signal, subprocess, sys, time
from types import SimpleNamespace
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
from vllm.snapshot.runtime import LocalSnapshotTools, SnapshotCreateError
vllms_own = LocalSnapshotTools.verify_dead

def dumped_tree():
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE,
        start_new_session=True)
    core = int(root.stdout.readline())
    tools = LocalSnapshotTools()
    tools._children[root.pid] = root
    os.killpg(root.pid, signal.SIGKILL)
    time.sleep(0.2)  # both are dead; the root's child is nobody's to reap yet
    return tools, SimpleNamespace(root_pid=root.pid, process_tree=(root.pid, core)), core

out = {}
if sys.argv[1] == "patched":
    _wait_dumped_tree()
tools, inventory, core = dumped_tree()
try:
    LocalSnapshotTools.verify_dead(tools, inventory)
    out["passed"] = True
except SnapshotCreateError as e:
    out["passed"], out["error"] = False, str(e)
out["core_gone"] = not os.path.exists(f"/proc/{core}")
out["patched"] = LocalSnapshotTools.verify_dead is not vllms_own
print(json.dumps(out))
"""


@pytest.mark.parametrize("patched", [False, True])
def test_vllms_snapshot_create_waits_for_the_dumped_tree_before_its_own_check(
        py: Path, patched: bool) -> None:
    """vLLM's create checks right after CRIU's dump that no process of the tree survived,
    while its engine core is still exiting: `process survived CRIU dump`. Pitstop's create
    runs as a subreaper and lets the tree be gone (reaped) before that check."""
    import subprocess

    from agent.engines.vllm.cli import DUMP_RACE_PATCH, VERSION_PATCH

    code = VERSION_PATCH + DUMP_RACE_PATCH + _DUMPED_TREE
    done = subprocess.run([str(py), "-c", code, "patched" if patched else "vllms"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["patched"] is patched
    if patched:
        assert out == {"passed": True, "core_gone": True, "patched": True}
    else:
        assert not out["passed"] and out["error"].startswith("process survived CRIU dump: ")
