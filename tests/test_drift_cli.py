"""`pitstop drift` against real snapshots: one dumped by real CRIU, one published through
the store, compared with this host's identity by the real command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.config import load_config
from agent.drift_watch import build_reader
from agent.engines import build_adapter
from agent.store import SnapshotStore
from tests.snapshot_helpers import CANARY, REPO, Counter, capture, publish, snapshotter

pytestmark = pytest.mark.integration


def write_config(path: Path, tmp: Path, args: list[str]) -> Path:
    path.write_text(yaml.safe_dump({
        "engine": {"kind": "reference", "model": str(tmp / "model"), "device": "cpu",
                   "args": args},
        "paths": {"state_dir": str(tmp / "state")},
    }))
    return path


def drift(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "drift", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def site(tiny_model: Path, tmp_path: Path) -> Path:
    shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "state").mkdir(mode=0o700)
    return tmp_path


def test_engine_args_changed_since_a_criu_snapshot_exit_1_old_to_new(site: Path):
    old_cfg = write_config(site / "old.yaml", site, ["--kv-slots", "8"])
    new_cfg = write_config(site / "new.yaml", site, ["--kv-slots", "4"])
    old = load_config(old_cfg)
    snap = snapshotter(old.paths.snapshots, site / "logs")
    taken_with = build_reader(old, build_adapter(old), snap.criu.version)()
    c = Counter(site / "c.sock")
    try:
        info = capture(snap, c.pid, canary=CANARY, identity=taken_with)
    finally:
        c.stop()
    assert any(f.name == "pstree.img" for f in info.manifest.files)  # a real CRIU image

    r = drift("--config", str(old_cfg))
    assert (r.returncode, r.stdout.strip()) == (0, f"snapshot {info.id} matches this host"), \
        r.stderr

    r = drift("--config", str(new_cfg))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("engine_args: ("), r.stdout
    before, after = lines[0].split(" -> ")
    assert before.endswith("'--kv-slots', '8')") and after.endswith("'--kv-slots', '4')")

    r = drift("--config", str(new_cfg), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["snapshot"] == info.id and out["drift"] is True
    [d] = out["differences"]
    assert d["field"] == "engine_args" and d["old"][-1] == "8" and d["new"][-1] == "4"


def test_a_weight_rewritten_since_a_given_snapshot_names_weights_digest(site: Path):
    cfg_path = write_config(site / "p.yaml", site, [])
    cfg = load_config(cfg_path)
    reader = build_reader(cfg, build_adapter(cfg), None)
    ident = reader()
    store = SnapshotStore(cfg.paths.snapshots)
    # The host has the CRIU `make criu` installed: record the one the command will find.
    from agent.checkpoint.criu_locate import locate

    ident = ident.model_copy(update={"criu": locate().version})
    m = publish(store, ident=ident)
    publish(store, minutes=5, ident=ident.model_copy(update={"kernel": "5.10.0"}))  # newest

    assert drift("--config", str(cfg_path), "--snapshot", m.id).returncode == 0
    newest = drift("--config", str(cfg_path))
    assert newest.returncode == 1 and newest.stdout.startswith("kernel: '5.10.0' -> ")

    with open(site / "model" / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\1\2\3")
    r = drift("--config", str(cfg_path), "--snapshot", m.id)
    assert r.returncode == 1
    assert r.stdout.startswith(f"weights_digest: {ident.weights_digest!r} -> 'sha256:")


def test_usage_errors_exit_2(site: Path):
    cfg_path = write_config(site / "p.yaml", site, [])
    r = drift("--config", str(cfg_path))
    assert r.returncode == 2 and "no readable snapshot" in r.stderr
    r = drift("--config", str(cfg_path), "--snapshot", "20260101T000000Z-full-abcdef")
    assert r.returncode == 2 and "no snapshot 20260101T000000Z-full-abcdef" in r.stderr
    (site / "bad.yaml").write_text("engine: {kind: nope}\n")
    r = drift("--config", str(site / "bad.yaml"))
    assert r.returncode == 2 and "engine.kind" in r.stderr
    assert drift("--bogus").returncode == 2
