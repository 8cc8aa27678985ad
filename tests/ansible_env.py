"""Where the Ansible tools live (`make ansible` puts them in .venv-ansible) and how to run them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_BIN = ROOT / ".venv-ansible" / "bin"
PLAYBOOKS = sorted((ROOT / "playbooks").glob("*.yml"))
EXAMPLE_INVENTORY = ROOT / "playbooks" / "inventory.example"


def ansible_env() -> dict[str, str]:
    """The environment for ansible-* commands: the repo's ansible.cfg, no colour, no cows."""
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_NOCOWS="1",
        PATH=f"{ANSIBLE_BIN}:{env.get('PATH', '')}",
    )
    return env


def run_ansible(tool: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run `tool` (ansible-lint, ansible-playbook...) from the repository root."""
    return subprocess.run([str(ANSIBLE_BIN / tool), *args], cwd=ROOT, env=ansible_env(),
                          capture_output=True, text=True, timeout=timeout)
