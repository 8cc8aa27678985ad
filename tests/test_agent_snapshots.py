"""The full-restore rung through the real agent: real CRIU, the real reference engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agentproc import (
    REPO,
    RunningAgent,
    agent_config,
    complete,
    fallthroughs,
    snapshot_list,
)
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required

pytestmark = pytest.mark.integration


def _generated_tokens(agent: RunningAgent) -> float:
    """The engine's own counter of generated tokens, read through its socket."""
    sock = Path(agent.config["paths"]["state_dir"]) / "run" / "engine.sock"
    out = subprocess.run(["curl", "-s", "--unix-socket", str(sock), "http://e/metrics"],
                         capture_output=True, text=True, timeout=30).stdout
    [line] = [x for x in out.splitlines() if x.startswith("refengine_generation_tokens_total")]
    return float(line.split()[-1])


@pytest.fixture
def snapped(tmp_path, tiny_model):
    """An agent that cold-started and then took its first snapshot (after-serving)."""
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model))
    a.wait_ready()
    a.wait_for(lambda s: s["state"] == "ready" and "published" in s.get("reason", ""), 120,
               "the first snapshot")
    yield a
    a.stop()


def test_a_cold_start_takes_a_snapshot_and_a_crash_is_restored_from_it(snapped):
    a = snapped
    before = complete(a)
    [snap] = snapshot_list(a)
    assert snap["kind"] == "full"
    pid = a.status()["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    st = a.wait_recovered(1)
    rec = st["last_recovery"]
    assert rec["path"] == "full" and rec["cause"] == "crash", rec
    assert "criu_restore" in rec["stages"]
    # CRIU gives the engine back its PID and the state it had at the dump.
    assert st["engine_pid"] == pid
    # The image was taken after the first canary (8 tokens); the restored engine adds its
    # own canary to that count, where a freshly started engine would be back at 8.
    assert _generated_tokens(a) >= 16
    assert complete(a) == before


def test_the_same_image_is_restored_again_and_again(snapped):
    a = snapped
    for n in range(1, 4):
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(n)
        assert st["last_recovery"]["path"] == "full"
    assert len(snapshot_list(a)) == 1


def _corrupt_and_kill(a: RunningAgent, damage) -> dict:
    [snap] = snapshot_list(a)
    sdir = Path(a.config["paths"]["state_dir"]) / "snapshots" / snap["id"]
    damage(sdir)
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    return a.wait_recovered(1, timeout=180)


def _flip_a_byte(sdir: Path) -> None:
    img = max((p for p in sdir.iterdir() if p.name.startswith("pages-")),
              key=lambda p: p.stat().st_size)
    with open(img, "r+b") as f:
        f.seek(img.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _truncate_manifest(sdir: Path) -> None:
    m = sdir / "manifest.json"
    m.write_bytes(m.read_bytes()[:100])


def _another_host(sdir: Path) -> None:
    m = sdir / "manifest.json"
    data = json.loads(m.read_text())
    data["identity"]["kernel"] = "5.15.0-other-host"
    m.write_text(json.dumps(data))


def _open_permissions(sdir: Path) -> None:
    os.chmod(sdir, 0o777)


@pytest.mark.parametrize(("damage", "words"), [
    (_flip_a_byte, "sha256"),
    (_truncate_manifest, "manifest"),
    (_another_host, "kernel"),
    (_open_permissions, "mode"),
])
def test_a_damaged_snapshot_is_refused_with_its_reason_and_the_engine_cold_starts(
        snapped, damage, words):
    st = _corrupt_and_kill(snapped, damage)
    rec = st["last_recovery"]
    assert rec["path"] == "cold", rec
    assert any(f.startswith("full skipped") and words in f for f in fallthroughs(rec)), rec
    assert words in snapped.log()


def test_snapshot_create_asks_the_running_agent(tmp_path, tiny_model):
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model,
                                            snapshots={"regenerate": "manual"}))
    try:
        a.wait_ready()
        assert snapshot_list(a) == []
        r = subprocess.run([sys.executable, "-m", "agent", "snapshot", "create", "--json",
                            "--config", str(a.config_path)], capture_output=True, text=True,
                           cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        made = json.loads(r.stdout)
        assert [s["id"] for s in snapshot_list(a)] == [made["id"]]
        assert made["freed_bytes"] > 0  # the KV pool stayed out of the image
        assert complete(a)  # still serving after the dump
    finally:
        a.stop()


def _rewrite_a_weight(model: Path) -> None:
    """Same size, different bytes, the old mtime put back: only a content hash sees it."""
    w = model / "model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-64] ^= 0x01
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))


def _add_a_file(model: Path) -> None:
    (model / "added_tokens.json").write_text("{}")


@pytest.mark.parametrize("change", [_rewrite_a_weight, _add_a_file])
def test_changed_weights_make_the_snapshot_stale_then_it_is_regenerated_and_restored(
        tmp_path, tiny_model, change):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    a = RunningAgent(tmp_path, agent_config(tmp_path, model,
                                            snapshots={"drift_check_interval_s": 1}))
    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        [first] = snapshot_list(a)
        change(model)
        st = a.wait_for(lambda s: (s.get("last_recovery") or {}).get("cause") == "drift"
                        and "published" in s.get("reason", ""), 180, "the regeneration")
        rec = st["last_recovery"]
        assert rec["path"] == "cold"
        assert any("stale: weights_digest" in f for f in fallthroughs(rec)), rec
        assert "drift: weights_digest" in a.log()
        ids = [s["id"] for s in snapshot_list(a)]
        assert len(ids) == 2 and first["id"] in ids
        os.kill(st["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(1)
        assert st["last_recovery"]["path"] == "full"
        assert f"restored snapshot {ids[0]}" in a.log()
    finally:
        a.stop()


def test_changed_engine_arguments_make_the_snapshot_stale(snapped):
    a = snapped
    a.config["engine"]["args"] = ["--kv-slots", "4"]
    a.write_config(a.config)
    a.proc.send_signal(signal.SIGHUP)
    st = a.wait_for(lambda s: (s.get("last_recovery") or {}).get("cause") == "reload"
                    and s["state"] == "ready", 120, "the reload")
    rec = st["last_recovery"]
    assert rec["path"] == "cold"
    assert any("stale: engine_args" in f for f in fallthroughs(rec)), rec
