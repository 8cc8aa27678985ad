"""`pitstop install-units` on a staging root: rendering, quoting, modes, offline enabling."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent import units
from agent.errors import UnitsError
from tests.prereq import require

REPO = Path(__file__).resolve().parent.parent
PITSTOP = Path(sys.executable).parent / "pitstop"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PITSTOP), "install-units", *args], capture_output=True,
                          text=True, timeout=60)


def test_the_package_ships_the_canonical_unit_files() -> None:
    for name in (*units.UNIT_FILES, units.SYSCTL_FILE, units.TMPFILES_FILE):
        # agent/units is a symlink to units/: one copy, in the wheel as package data.
        assert units.shipped(name) == (REPO / "units" / name).read_text()


def test_install_renders_every_placeholder_with_this_installation(tmp_path: Path) -> None:
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text("engine: {model: /m}\npaths: {state_dir: /srv/ps, run_dir: /run/ps}\n")
    paths = units.paths_for(Path("/opt/pitstop venv/bin/pitstop"), cfg)
    written = units.install(tmp_path / "root", paths)
    assert len(written) == 7
    for f in written:
        text = f.read_text()
        assert not re.search(r"@[A-Z_]+@", text), f
        assert f.stat().st_mode & 0o777 == 0o644
    agent = (tmp_path / "root/etc/systemd/system/pitstop-agent.service").read_text()
    assert f'ExecStart="/opt/pitstop venv/bin/pitstop" run --config {cfg}' in agent
    template = (tmp_path / "root/etc/systemd/system/pitstop-agent@.service").read_text()
    assert 'ExecStart="/opt/pitstop venv/bin/pitstop" run --engine %i --engines-dir ' \
        '/etc/pitstop/engines' in template
    assert "Description=Pitstop agent of engine %i " in template
    assert "SyslogIdentifier=pitstop@%i" in template
    # One text, two units: everything but the lines naming the engine is the same.
    differ = {a for a, b in zip(agent.splitlines(), template.splitlines(), strict=True)
              if a != b}
    assert {d.split("=")[0] for d in differ} == {"Description", "ExecStart", "SyslogIdentifier"}
    tmpfiles = (tmp_path / "root/etc/tmpfiles.d/pitstop.conf").read_text()
    assert "d /srv/ps 0700" in tmpfiles and "d /srv/ps/snapshots 0700" in tmpfiles
    assert "D /run/ps 0700" in tmpfiles


def test_a_missing_config_gives_the_default_directories(tmp_path: Path) -> None:
    paths = units.paths_for(Path("/usr/bin/pitstop"), tmp_path / "absent.yaml")
    assert paths.state_dir == Path("/var/lib/pitstop")
    assert paths.snapshot_dir == Path("/var/lib/pitstop/snapshots")


@pytest.mark.parametrize(("path", "word"), [
    ("/a/b", "/a/b"),
    ("/a/100%/b", "/a/100%%/b"),
    ("/a/$HOME", "/a/$$HOME"),
    ("/a b/c", '"/a b/c"'),
])
def test_exec_paths_are_quoted_for_systemd(path: str, word: str) -> None:
    assert units.systemd_quote(Path(path)) == word


def test_relative_and_unquotable_paths_are_refused() -> None:
    with pytest.raises(UnitsError, match="absolute"):
        units.systemd_quote(Path("bin/pitstop"))
    with pytest.raises(UnitsError, match="double quote"):
        units.systemd_quote(Path('/a "b"/c'))


def test_the_cli_installs_and_enables_offline_under_a_prefix(tmp_path: Path) -> None:
    require(shutil.which("systemctl"), "systemctl is needed for `systemctl --root` enabling")
    r = _cli("--prefix", str(tmp_path), "--config", str(REPO / "examples" / "pitstop.yaml"),
             "--enable", "--holder", "GPU-0a1b2c3d-0000-1111-2222-333344445555")
    assert r.returncode == 0, r.stderr
    etc = tmp_path / "etc/systemd/system"
    assert os.readlink(etc / "multi-user.target.wants/pitstop-agent.service") == \
        "/etc/systemd/system/pitstop-agent.service"
    holder = etc / "pitstop-holders.target.wants/pitstop-holder@GPU-0a1b2c3d-0000-1111-2222-" \
        "333344445555.service"
    assert os.readlink(holder) == "/etc/systemd/system/pitstop-holder@.service"
    assert f"ExecStart={PITSTOP} run" in (etc / "pitstop-agent.service").read_text()


def test_the_cli_refuses_a_holder_name_that_is_not_a_gpu_uuid(tmp_path: Path) -> None:
    r = _cli("--prefix", str(tmp_path), "--enable", "--holder", "../../evil")
    assert r.returncode == 1
    assert "not a GPU UUID" in r.stderr


def test_the_cli_names_an_invalid_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {model: /m}\nbogus: 1\n")
    r = _cli("--prefix", str(tmp_path), "--config", str(bad))
    assert r.returncode == 2
    assert "bogus" in r.stderr and str(bad) in r.stderr


def _engine(d: Path, name: str, port: int, state: str, args: str = "[]",
            env: str = "{}") -> Path:
    d.mkdir(exist_ok=True)
    f = d / f"{name}.yaml"
    f.write_text(f"engine: {{model: /m, args: {args}, env: {env}}}\n"
                 f"front: {{port: {port}}}\nmetrics: {{port: {port + 1000}}}\n"
                 f"paths: {{state_dir: {state}, run_dir: /run/pitstop/engines/{name}}}\n")
    return f


def test_the_tmpfiles_snippet_makes_every_engines_directories(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    _engine(engines, "a", 8001, "/var/lib/pitstop/engines/a")
    _engine(engines, "b", 8002, "/var/lib/pitstop/engines/b")
    from agent.node import load_engines

    paths = units.paths_for(Path("/usr/bin/pitstop"), tmp_path / "absent.yaml",
                            engines_dir=engines, engines=tuple(load_engines(engines)))
    units.install(tmp_path / "root", paths)
    tmpfiles = (tmp_path / "root/etc/tmpfiles.d/pitstop.conf").read_text()
    for name in ("a", "b"):
        assert f"d /var/lib/pitstop/engines/{name} 0700 root root -" in tmpfiles
        assert f"d /var/lib/pitstop/engines/{name}/snapshots 0700" in tmpfiles
        assert f"D /run/pitstop/engines/{name} 0700" in tmpfiles
    template = (tmp_path / "root/etc/systemd/system/pitstop-agent@.service").read_text()
    assert f"--engines-dir {engines}" in template


def test_the_cli_enables_one_agent_per_engine_offline(tmp_path: Path) -> None:
    require(shutil.which("systemctl"), "systemctl is needed for `systemctl --root` enabling")
    engines = tmp_path / "engines"
    _engine(engines, "a", 8001, "/var/lib/pitstop/engines/a")
    _engine(engines, "b", 8002, "/var/lib/pitstop/engines/b")
    r = _cli("--prefix", str(tmp_path / "root"), "--engines-dir", str(engines), "--enable")
    assert r.returncode == 0, r.stderr
    wants = tmp_path / "root/etc/systemd/system/multi-user.target.wants"
    assert sorted(p.name for p in wants.iterdir() if p.name.startswith("pitstop-agent")) == \
        ["pitstop-agent@a.service", "pitstop-agent@b.service"]
    assert os.readlink(wants / "pitstop-agent@a.service") == \
        "/etc/systemd/system/pitstop-agent@.service"


def test_the_cli_refuses_engines_that_claim_one_port_naming_both_files(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    a = _engine(engines, "a", 8001, "/var/lib/pitstop/engines/a")
    b = _engine(engines, "b", 8001, "/var/lib/pitstop/engines/b")
    r = _cli("--prefix", str(tmp_path / "root"), "--engines-dir", str(engines))
    assert r.returncode == 2
    assert f"{a} and {b} both listen on port 8001" in r.stderr, r.stderr
    assert not (tmp_path / "root").exists()
