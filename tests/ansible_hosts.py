"""Test hosts for the Ansible roles: systemd containers, a local apt repository, an inventory."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.ansible_env import ROOT
from tests.systemd_container import Bind, SystemdContainer, python_binds

ROOTFS = {"deb12": ROOT / ".cache" / "rootfs" / "ansible-bookworm",
          "deb13": ROOT / ".cache" / "rootfs" / "ansible-trixie"}
WHEELHOUSE = ROOT / ".cache" / "ansible-wheelhouse"
# Where the hosts see the controller's apt repository and wheelhouse (read-only binds),
# as hosts behind a mirror would: the containers have no network.
APT_DIR = Path("/srv/apt")
WHEEL_DIR = Path("/srv/wheelhouse")
# The stand-in for the NVIDIA driver: a real package, pinned and held like the driver.
DRIVER = "pitstop-test-driver"
DRIVER_VERSIONS = ("1.0-1", "2.0-1", "3.0-1")
# A host where this file exists fails to configure the driver package (its postinst exits 1).
FAIL_MARKER = "/etc/pitstop-test-fail"


def build_deb(out: Path, name: str, version: str, postinst: str = "") -> Path:
    """A real .deb made with dpkg-deb: a control file, one file under /usr/share/NAME."""
    tree = out / f"{name}_{version}"
    (tree / "DEBIAN").mkdir(parents=True, exist_ok=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: Pitstop tests "
        f"<tests@pitstop.invalid>\nDescription: {name} {version}, made by the Ansible tests\n")
    if postinst:
        p = tree / "DEBIAN" / "postinst"
        p.write_text(postinst)
        p.chmod(0o755)
    (tree / "usr" / "share" / name).mkdir(parents=True, exist_ok=True)
    (tree / "usr" / "share" / name / "VERSION").write_text(version + "\n")
    deb = out / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


def make_apt_repo(out: Path, kernel_release: str) -> None:
    """A flat file: repository with the driver stand-in in three versions and the running
    kernel's image package, which the kernel role holds."""
    out.mkdir(parents=True, exist_ok=True)
    fail = (f"#!/bin/sh\nif [ -e {FAIL_MARKER} ]; then echo 'test driver: this host is "
            f"marked to fail' >&2; exit 1; fi\n")
    for v in DRIVER_VERSIONS:
        build_deb(out, DRIVER, v, postinst=fail if v == DRIVER_VERSIONS[-1] else "")
    build_deb(out, f"linux-image-{kernel_release}", "1")
    packages = subprocess.run(["dpkg-scanpackages", "--multiversion", "."], cwd=out,
                              check=True, capture_output=True, text=True).stdout
    (out / "Packages").write_text(packages)


def make_criu_bundle(out: Path) -> Path:
    """The bundle the criu role copies to every host whose distribution's CRIU is older than
    4.2 (criu_prefix_bundle), made as an operator makes it on the controller: `make
    criu-bundle` (scripts/install-criu.sh bundle), Debian forky's CRIU with its loader."""
    if not (out / "sbin" / "criu").exists():
        subprocess.run([str(ROOT / "scripts/install-criu.sh"), "bundle", str(out)], check=True,
                       capture_output=True, text=True, timeout=900)
    return out


@dataclass
class Fleet:
    """The test fleet: containers by inventory name, the inventory file, the scratch dir."""

    hosts: dict[str, SystemdContainer]
    inventory: Path
    scratch: Path

    def write_inventory(self, host_overrides: dict[str, dict] | None = None,
                        **overrides: object) -> None:
        """The inventory with the driver pin and any group variable overridden, and any
        host's variables (`host_overrides`: {host: {name: value}})."""
        group_vars = base_vars(self.scratch)
        group_vars.update(overrides)
        doc = {"pitstop_nodes": {
            "hosts": {name: {"ansible_connection": "community.docker.nsenter",
                             "ansible_nsenter_pid": c.leader_pid,
                             "ansible_python_interpreter": "/usr/bin/python3",
                             # nsenter is root already, and the hosts have no sudo.
                             "ansible_become": False,
                             **host_vars(name, self.scratch),
                             **(host_overrides or {}).get(name, {})}
                      for name, c in self.hosts.items()},
            "vars": group_vars}}
        self.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))


def base_vars(scratch: Path) -> dict[str, object]:
    """Group variables: the real roles, with what a container cannot have turned off."""
    return {
        # The driver stand-in, pinned and held exactly as the NVIDIA packages would be.
        "nvidia_driver_packages": [DRIVER],
        "nvidia_driver_version": DRIVER_VERSIONS[0],
        # No GPU, no module to load, no persistence daemon, no reboot of a container.
        "nvidia_driver_verify_loaded": False,
        "nvidia_driver_persistence_mode": False,
        "nvidia_driver_reboot": False,
        # Keep the running kernel; no GRUB in a container, and no reboot.
        "kernel_reboot": False,
        # /proc/sys is read-only in a container: the sysctl file is written, not applied.
        "criu_sysctl_apply": False,
        # `criu check` needs the host's full privileges.
        "criu_run_check": False,
        "criu_prefix_bundle": str(scratch / "criu-bundle"),
        "pitstop_source": str(ROOT),
        "pitstop_build_dir": str(scratch / "wheel"),
        "pitstop_pip_extra_args": f"--no-index --find-links {WHEEL_DIR}",
        "pitstop_make_model": True,
        "pitstop_ready_retries": 90,
        "pitstop_ready_delay": 2,
        "pitstop_config": {
            "engine": {"kind": "reference", "model": "/var/lib/pitstop/models/tiny-llama",
                       "served_model_name": "tiny-llama", "device": "cpu"},
            # Each container has its own network namespace: the same port on every host.
            "front": {"host": "127.0.0.1", "port": 8000},
            "paths": {"state_dir": "/var/lib/pitstop", "run_dir": "/run/pitstop"},
            "metrics": {"host": "127.0.0.1", "port": 9410},
        },
        # A rollout waits for the snapshot taken after the drift and checks the canary.
        "pitstop_rollout_require_snapshot": True,
        "pitstop_rollout_verify_canary": True,
    }


def host_vars(name: str, scratch: Path) -> dict[str, object]:
    """Debian 13's Python is 3.13 and the only CPU torch wheel here is cp311: that host makes
    the agent's virtualenv with the controller's Python 3.11, bound read-only at its own path
    (a fleet with its own Python build does the same through pitstop_python)."""
    if name == "deb13":
        return {"pitstop_python": f"{sys.base_prefix}/bin/python3"}
    return {}


def container_binds(scratch: Path, name: str) -> list[Bind]:
    binds = [Bind(scratch / "apt", target=APT_DIR), Bind(WHEELHOUSE, target=WHEEL_DIR)]
    if name == "deb13":
        binds += python_binds()
    return binds


def use_local_repo(c: SystemdContainer) -> None:
    """Point the host's apt at the local repository only (it has no network)."""
    c.sh("rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*; "
         f"echo 'deb [trusted=yes] file:{APT_DIR} ./' > /etc/apt/sources.list.d/pitstop-test.list;"
         " apt-get update -q >/dev/null")


RECAP = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines as {host: {ok, changed, unreachable, failed}}."""
    return {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]),
                   "failed": int(m[5])} for m in RECAP.finditer(output)}


def installed_version(c: SystemdContainer, package: str) -> str:
    r = c.run(["dpkg-query", "-W", "-f=${Status} ${Version}", package], check=False)
    parts = r.stdout.split()
    return parts[-1] if r.returncode == 0 and "installed" in parts else ""


def dpkg_installed_at(c: SystemdContainer, package: str, version: str) -> str:
    """The dpkg.log time stamp ("YYYY-MM-DD HH:MM:SS") of `package` reaching `version`."""
    log = c.run(["cat", "/var/log/dpkg.log"]).stdout
    stamps = [" ".join(line.split()[:2]) for line in log.splitlines()
              if f" status installed {package}:all {version}" in line]
    return stamps[-1] if stamps else ""


def agent_status(c: SystemdContainer) -> dict:
    r = c.run(["/opt/pitstop/venv/bin/pitstop", "status", "--json", "--config",
               "/etc/pitstop/pitstop.yaml"], check=False)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {"state": f"no status ({r.stderr.strip()[-200:]})"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
