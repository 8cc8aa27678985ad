"""Finding CRIU: explicit paths win, old versions are refused, `make criu`'s wrapper works."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from agent.checkpoint.criu_locate import MIN_TEXT, MIN_VERSION, locate
from agent.errors import SnapshotError
from tests.snapshot_helpers import REPO, criu


def _fake(tmp_path: Path, version: str) -> Path:
    # A stand-in that prints a version: the thing under test is locate's choice, not CRIU.
    p = tmp_path / f"criu-{version}"
    p.write_text(f"#!/bin/sh\necho 'Version: {version}'\n")
    p.chmod(0o755)
    return p


def test_the_installed_criu_is_at_least_the_minimum():
    c = criu()
    assert tuple(int(x) for x in c.version.split(".")[:2]) >= MIN_VERSION


def test_an_old_criu_is_refused_with_the_fix(tmp_path: Path):
    old = _fake(tmp_path, "3.17.1")
    with pytest.raises(SnapshotError, match=r"is 3\.17\.1; Pitstop needs >= 4\.2.*vDSO.*make criu"):
        locate(old)
    with pytest.raises(SnapshotError, match=r"from \$PITSTOP_CRIU"):
        locate(environ={"PITSTOP_CRIU": str(old)})


def test_criu_4_1_is_refused_naming_the_tcp_bug_of_linux_6_16(tmp_path: Path):
    with pytest.raises(SnapshotError) as refused:
        locate(_fake(tmp_path, "4.1.1"))
    said = str(refused.value)
    assert "is 4.1.1; Pitstop needs >= 4.2" in said
    assert "Linux >= 6.16" in said and "TCP socket" in said and "CRIU issue 2705" in said


def test_the_install_script_and_the_role_ask_for_the_same_minimum():
    text = MIN_TEXT
    script = (REPO / "scripts" / "install-criu.sh").read_text()
    assert re.search(r"^MIN_VERSION=(\S+)$", script, re.M).group(1) == text
    defaults = yaml.safe_load((REPO / "roles/criu/defaults/main.yml").read_text())
    assert defaults["criu_min_version"] == text
    specs = yaml.safe_load((REPO / "roles/criu/meta/argument_specs.yml").read_text())
    assert specs["argument_specs"]["main"]["options"]["criu_min_version"]["default"] == text


def test_config_beats_env_beats_the_wrapper_beats_path(tmp_path: Path):
    a, b = _fake(tmp_path, "4.2.1"), _fake(tmp_path, "4.3.0")
    assert locate(a, environ={"PITSTOP_CRIU": str(b)}).path == a
    got = locate(environ={"PITSTOP_CRIU": str(b)})
    assert (got.path, got.version, got.source) == (b, "4.3.0", "$PITSTOP_CRIU")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "criu").symlink_to(b)
    got = locate(environ={"PATH": str(bindir)}, repo_wrapper=tmp_path / "none", sbin_dirs=())
    assert got.path == bindir / "criu" and got.source == "PATH"
    with pytest.raises(SnapshotError, match="no CRIU found"):
        locate(environ={"PATH": str(tmp_path / "e")}, repo_wrapper=tmp_path / "none", sbin_dirs=())


def test_the_bundle_for_gpu_hosts_runs_on_its_own(tmp_path: Path):
    criu()
    out = tmp_path / "bundle"
    subprocess.run([str(REPO / "scripts" / "install-criu.sh"), "bundle", str(out)], check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    r = subprocess.run([str(out / "bin" / "criu"), "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and f"Version: {MIN_TEXT}" in r.stdout
    assert (out / "lib" / "ld-linux-x86-64.so.2").exists()
