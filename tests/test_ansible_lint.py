"""ansible-lint's production profile and ansible-playbook --syntax-check on every playbook."""

from __future__ import annotations

import pytest

from tests.ansible_env import ANSIBLE_BIN, EXAMPLE_INVENTORY, PLAYBOOKS, ROOT, run_ansible
from tests.prereq import require


@pytest.fixture(autouse=True)
def _ansible_installed() -> None:
    require((ANSIBLE_BIN / "ansible-lint").exists(), "no .venv-ansible: run `make ansible`")


def test_the_playbooks_exist() -> None:
    assert {p.name for p in PLAYBOOKS} >= {"site.yml", "pin.yml", "rollout.yml", "report.yml"}


def test_ansible_lint_production_profile_is_clean() -> None:
    r = run_ansible("ansible-lint", "--nocolor", "--offline", timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out


@pytest.mark.parametrize("playbook", PLAYBOOKS, ids=lambda p: p.name)
def test_playbook_syntax(playbook) -> None:
    r = run_ansible("ansible-playbook", "--syntax-check", "-i", str(EXAMPLE_INVENTORY),
                    str(playbook))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("role", ["nvidia_driver", "kernel", "criu", "pitstop"])
def test_role_has_the_expected_parts(role: str) -> None:
    base = ROOT / "roles" / role
    for part in ("defaults/main.yml", "meta/main.yml", "meta/argument_specs.yml",
                 "handlers/main.yml", "tasks/main.yml", "README.md"):
        assert (base / part).is_file(), f"roles/{role}/{part} is missing"
    assert any((base / "vars").glob("*.yml")), f"roles/{role}/vars has no OS family file"
