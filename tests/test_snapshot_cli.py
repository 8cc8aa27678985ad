"""`pitstop snapshot list|inspect|verify|delete` and `pitstop doctor`, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.cli import main
from agent.store import SnapshotStore
from tests.snapshot_helpers import criu, publish


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, SnapshotStore]:
    cfg = tmp_path / "pitstop.yaml"
    root = tmp_path / "snaps"
    cfg.write_text(yaml.safe_dump({
        "engine": {"kind": "reference", "model": str(tmp_path / "model")},
        "paths": {"state_dir": str(tmp_path / "state"), "snapshot_dir": str(root)},
    }))  # fmt: skip
    store = SnapshotStore(root)
    store.open()
    return cfg, store


def _json(capsys: pytest.CaptureFixture[str]) -> object:
    return json.loads(capsys.readouterr().out)


def test_list_inspect_verify_delete(setup, capsys):
    cfg, store = setup
    a, b = publish(store, minutes=0), publish(store, minutes=1)
    assert main(["snapshot", "list", "--config", str(cfg), "--json"]) == 0
    listed = _json(capsys)
    assert [e["id"] for e in listed] == [b.id, a.id] and listed[0]["problem"] is None
    assert main(["snapshot", "list", "--config", str(cfg)]) == 0
    assert b.id in capsys.readouterr().out

    assert main(["snapshot", "inspect", b.id, "--config", str(cfg), "--json"]) == 0
    assert _json(capsys)["identity"]["kernel"] == b.identity.kernel
    assert main(["snapshot", "inspect", b.id, "--config", str(cfg)]) == 0
    assert "kernel" in capsys.readouterr().out

    assert main(["snapshot", "verify", "--config", str(cfg)]) == 0
    capsys.readouterr()
    with open(store.path(a.id) / "pages-1.img", "r+b") as f:
        f.write(b"\x00\x01")
    assert main(["snapshot", "verify", "--config", str(cfg), "--json"]) == 1
    verdicts = {v["id"]: v for v in _json(capsys)}
    assert verdicts[b.id]["ok"] and not verdicts[a.id]["ok"]
    assert "sha256" in verdicts[a.id]["reasons"][0]

    assert main(["snapshot", "delete", a.id, "--config", str(cfg)]) == 0
    assert store.ids() == [b.id]
    capsys.readouterr()
    assert main(["snapshot", "inspect", a.id, "--config", str(cfg)]) == 1
    assert f"no snapshot {a.id}" in capsys.readouterr().err


def test_doctor_reports_each_item_and_its_exit_status(setup, capsys):
    cfg, _ = setup
    criu()  # `make criu` is a prerequisite of a passing doctor
    rc = main(["doctor", "--config", str(cfg), "--json"])
    checks = {c["name"]: c for c in _json(capsys)}
    assert set(checks) == {"criu", "criu check", "privileges", "amx", "io_uring",
                           "transparent huge pages", "criu kernel cache", "cuda checkpoint",
                           "persistence mode", "free space"}  # fmt: skip
    assert checks["criu"]["ok"] and checks["criu check"]["ok"]
    assert all(c["fix"] for c in checks.values() if not c["ok"])
    assert rc == (1 if any(c["needed"] and not c["ok"] for c in checks.values()) else 0)


@pytest.mark.parametrize("flags, says", [
    ("fpu avx512f amx_bf16 amx_tile amx_int8", "each restore asks for it again"),
    ("fpu avx2", "no AMX"),
])  # fmt: skip
def test_doctor_says_whether_the_cpu_has_amx_and_that_restores_regrant_it(
    setup, tmp_path: Path, flags: str, says: str
):
    from agent.config import load_config
    from agent.doctor import Check, run_checks

    cfg, _ = setup
    fake = tmp_path / "proc"
    (fake / "self").mkdir(parents=True)
    (fake / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n\n")
    (fake / "self" / "status").write_text("CapEff:\t0000000000000000\n")
    checks = run_checks(load_config(cfg), proc_root=fake,
                        gpu_probe=lambda: (False, Check("persistence mode", True, False, "-")))
    amx = next(c for c in checks if c.name == "amx")
    assert says in amx.detail


@pytest.mark.parametrize("enabled, ok", [
    ("[always] madvise never\n", True),
    ("always [madvise] never\n", False),
])  # fmt: skip
def test_doctor_warns_when_restores_get_no_huge_pages(setup, tmp_path: Path, enabled: str,
                                                      ok: bool):
    from agent.config import load_config
    from agent.doctor import Check, run_checks

    cfg, _ = setup
    thp = tmp_path / "enabled"
    thp.write_text(enabled)
    checks = run_checks(load_config(cfg), thp_path=thp,
                        gpu_probe=lambda: (False, Check("persistence mode", True, False, "-")))
    item = next(c for c in checks if c.name == "transparent huge pages")
    assert item.ok is ok and not item.needed
    assert ok or ("madvise" in item.detail and f"echo always > {thp}" in (item.fix or ""))


MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:21 / {run} rw,nosuid,nodev shared:5 - {fs} tmpfs rw,mode=755
24 23 0:22 / {run}/user/0 rw,nosuid,nodev shared:6 - tmpfs tmpfs rw,mode=700
25 22 0:23 / {run}ner rw shared:7 - ext4 /dev/vdb rw
"""


@pytest.mark.parametrize("run_fs, leftover, ok, says", [
    ("tmpfs", False, True, "is a tmpfs"),
    ("ext4", False, False, "probes the kernel again"),
    ("tmpfs", True, False, "no CRIU can save it"),
])  # fmt: skip
def test_doctor_warns_when_criu_cannot_keep_its_kernel_probe(
    setup, tmp_path: Path, run_fs: str, leftover: bool, ok: bool, says: str
):
    from agent.config import load_config
    from agent.doctor import Check, run_checks

    cfg, _ = setup
    fake = tmp_path / "proc"
    (fake / "self").mkdir(parents=True)
    (fake / "self" / "status").write_text("CapEff:\t0000000000000000\n")
    run = tmp_path / "run"
    run.mkdir()
    (fake / "self" / "mountinfo").write_text(MOUNTINFO.format(run=run, fs=run_fs))
    if leftover:
        (run / "criu.kdat.tmp").write_bytes(b"")
    checks = run_checks(load_config(cfg), proc_root=fake, run_dir=run,
                        gpu_probe=lambda: (False, Check("persistence mode", True, False, "-")))
    item = next(c for c in checks if c.name == "criu kernel cache")
    assert item.ok is ok and not item.needed and says in item.detail
    assert ok or item.fix


def test_doctor_fails_with_a_fix_when_criu_is_missing(tmp_path: Path, capsys):
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text(yaml.safe_dump({
        "engine": {"kind": "reference", "model": str(tmp_path / "model")},
        "paths": {"state_dir": str(tmp_path / "state")},
        "snapshots": {"criu": str(tmp_path / "no-criu")},
    }))  # fmt: skip
    assert main(["doctor", "--config", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  criu" in out and "fix: run `make criu`" in out


def test_doctor_names_the_tcp_bug_of_criu_4_1(tmp_path: Path, capsys):
    old = tmp_path / "criu-4.1"
    old.write_text("#!/bin/sh\necho 'Version: 4.1.1'\n")
    old.chmod(0o755)
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text(yaml.safe_dump({
        "engine": {"kind": "reference", "model": str(tmp_path / "model")},
        "paths": {"state_dir": str(tmp_path / "state")},
        "snapshots": {"criu": str(old)},
    }))  # fmt: skip
    assert main(["doctor", "--config", str(cfg), "--json"]) == 1
    said = {c["name"]: c for c in _json(capsys)}["criu"]
    assert not said["ok"] and "is 4.1.1; Pitstop needs >= 4.2" in said["detail"]
    assert "Linux >= 6.16" in said["detail"] and "CRIU issue 2705" in said["detail"]
    assert "make criu" in said["fix"]


def test_build_snapshotter_follows_the_config(setup):
    from agent.checkpoint import build_snapshotter
    from agent.config import load_config

    cfg, store = setup
    criu()
    snap = build_snapshotter(load_config(cfg))
    assert snap.store.root == store.root
    assert snap.store.retention.keep == 2 and snap.store.retention.budget_bytes == 64 << 30
    assert snap.criu.version.startswith("4.")
