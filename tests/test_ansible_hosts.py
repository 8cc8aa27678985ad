"""The playbooks against real hosts: Debian 12 and 13 booted under systemd-nspawn, reached
through Ansible's community.docker.nsenter connection, in the order an operator works:
site.yml, site.yml again (no change), the pins in effect, a rollout of a new pin one host at a
time, a rollout that stops at a failing host; then a host of two engines (one agent each),
rolled out engine by engine, and reported engine by engine."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import yaml

from agent.checkpoint.criu_locate import MIN_TEXT
from tests.ansible_env import ANSIBLE_BIN, ROOT, run_ansible
from tests.ansible_hosts import (
    DRIVER,
    DRIVER_VERSIONS,
    FAIL_MARKER,
    ROOTFS,
    WHEELHOUSE,
    Fleet,
    agent_status,
    base_vars,
    container_binds,
    dpkg_installed_at,
    installed_version,
    make_apt_repo,
    make_criu_bundle,
    recap,
    use_local_repo,
)
from tests.prereq import require
from tests.systemd_container import SystemdContainer, container_prerequisites
from tests.tlskit import TestCA

pytestmark = pytest.mark.integration


def _playbook(fleet: Fleet, name: str, *extra: str) -> tuple[int, str]:
    r = run_ansible("ansible-playbook", "-i", str(fleet.inventory), *extra,
                    str(ROOT / "playbooks" / name), timeout=1500)
    out = r.stdout + r.stderr
    (fleet.scratch / f"{name}.log").open("a").write(out)
    return r.returncode, out


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    for rootfs in ROOTFS.values():
        missing = container_prerequisites(rootfs)
        require(not missing, f"cannot boot the test hosts: {', '.join(missing)}; run `make test`")
    require((ANSIBLE_BIN / "ansible-playbook").exists(), "no .venv-ansible: run `make ansible`")
    require((WHEELHOUSE / ".stamp").exists(), "no wheelhouse: run `make ansible-hosts`")
    scratch = Path(tempfile.mkdtemp(prefix="pitstop-ansible-", dir="/var/tmp"))
    hosts: dict[str, SystemdContainer] = {}
    try:
        make_apt_repo(scratch / "apt", os.uname().release)
        make_criu_bundle(scratch / "criu-bundle")
        for name, rootfs in ROOTFS.items():
            # A name of its own: the container's cgroup is named after it, and two runs of
            # this module on one machine must not share one.
            c = SystemdContainer(rootfs=rootfs, binds=container_binds(scratch, name),
                                 log_path=scratch / f"{name}.boot.log",
                                 name=f"ansible-{name}-{uuid.uuid4().hex[:6]}")
            hosts[name] = c
            c.start()
            use_local_repo(c)
        f = Fleet(hosts=hosts, inventory=scratch / "inventory.yml", scratch=scratch)
        f.write_inventory()
        yield f
    finally:
        for c in hosts.values():
            with contextlib.suppress(Exception):
                c.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def test_site_brings_the_agent_up_under_systemd(fleet: Fleet) -> None:
    rc, out = _playbook(fleet, "site.yml")
    assert rc == 0, out[-6000:]
    for name, c in fleet.hosts.items():
        assert c.systemctl("is-active", "pitstop-agent.service", check=False).strip() == "active", \
            f"{name}: {c.journal('pitstop-agent.service')[-3000:]}"
        assert agent_status(c)["state"] == "ready", name
        # CRIU >= 4.2 on both: Debian 12 and 13 ship older ones (13 has 4.1.1 installed,
        # which fails on TCP sockets on Linux >= 6.16), so both run the private prefix.
        version = c.run(["/usr/local/sbin/criu", "--version"]).stdout
        assert f"Version: {MIN_TEXT}" in version, (name, version)
        assert "/opt/pitstop/criu" in c.run(["cat", "/usr/local/sbin/criu"]).stdout, name
        assert c.run(["cat", "/etc/sysctl.d/90-pitstop-criu.conf"]).stdout.strip() \
            .endswith("kernel.io_uring_disabled=2")
    deb13 = fleet.hosts["deb13"]
    assert "Version: 4.1" in deb13.run(["/usr/sbin/criu", "--version"]).stdout, \
        "the Debian 13 host should still have its own (older) criu, left alone by the role"


def test_site_again_changes_nothing(fleet: Fleet) -> None:
    rc, out = _playbook(fleet, "site.yml")
    assert rc == 0, out[-6000:]
    counts = recap(out)
    assert set(counts) == set(fleet.hosts), out[-3000:]
    for host, c in counts.items():
        assert c["changed"] == 0 and c["failed"] == 0, (host, c, out[-6000:])


def test_a_bad_config_is_refused_and_the_running_one_kept(fleet: Fleet) -> None:
    c = fleet.hosts["deb12"]
    before = c.run(["cat", "/etc/pitstop/pitstop.yaml"]).stdout
    bad = base_vars(fleet.scratch)["pitstop_config"]
    fleet.write_inventory(pitstop_config={**bad, "health": {"intervl_s": 1}})
    try:
        rc, out = _playbook(fleet, "site.yml", "--limit", "deb12")
    finally:
        fleet.write_inventory()
    assert rc != 0, out[-4000:]
    # The agent's own message, from `pitstop check-config` run by the template's validate:.
    assert "health.intervl_s: unknown key" in out, out[-4000:]
    assert c.run(["cat", "/etc/pitstop/pitstop.yaml"]).stdout == before
    assert c.systemctl("is-active", "pitstop-agent.service", check=False).strip() == "active"
    assert agent_status(c)["state"] == "ready"


def test_the_pins_are_in_effect(fleet: Fleet) -> None:
    kernel_pkg = f"linux-image-{os.uname().release}"
    for name, c in fleet.hosts.items():
        held = c.run(["apt-mark", "showhold"]).stdout.split()
        assert DRIVER in held, (name, held)
        policy = c.run(["apt-cache", "policy", DRIVER]).stdout
        assert f"Installed: {DRIVER_VERSIONS[0]}" in policy, policy
        # The pin makes the pinned version the candidate although newer ones are offered.
        assert f"Candidate: {DRIVER_VERSIONS[0]}" in policy, policy
        assert f"*** {DRIVER_VERSIONS[0]} 1001" in policy, policy
        assert "1001" in c.run(["cat", "/etc/apt/preferences.d/pitstop-nvidia-driver.pref"]).stdout
        # An upgrade does not move a held, pinned package.
        c.run(["apt-get", "-y", "-q", "upgrade"])
        assert installed_version(c, DRIVER) == DRIVER_VERSIONS[0], name
        # The kernel role keeps the running kernel and holds its package, once one is installed.
        c.run(["apt-get", "install", "-y", "-q", kernel_pkg])
    rc, out = _playbook(fleet, "pin.yml")
    assert rc == 0, out[-6000:]
    for name, c in fleet.hosts.items():
        assert kernel_pkg in c.run(["apt-mark", "showhold"]).stdout.split(), name
        # Huge pages at every boot (the container's /sys is read-only: set at its next boot).
        thp = c.run(["cat", "/etc/tmpfiles.d/pitstop-thp.conf"]).stdout
        assert "w /sys/kernel/mm/transparent_hugepage/enabled - - - - always" in thp, thp


def _drifted_config(fleet: Fleet) -> dict:
    """The agent's configuration with other engine arguments: a drift the snapshot identity
    sees (the stand-in driver package is not in it, a real driver is), so every host's
    snapshot goes stale and the agent must take a new one after its upgrade."""
    config = base_vars(fleet.scratch)["pitstop_config"]
    return {**config, "engine": {**config["engine"], "args": ["--kv-slots", "4"]}}


def _snapshots(c: SystemdContainer) -> list[str]:
    r = c.run(["sh", "-c", "ls /var/lib/pitstop/snapshots/*/manifest.json"], check=False)
    return r.stdout.split()


def test_rollout_upgrades_one_host_at_a_time(fleet: Fleet) -> None:
    new = DRIVER_VERSIONS[1]
    old_snapshots = {name: _snapshots(c) for name, c in fleet.hosts.items()}
    fleet.write_inventory(nvidia_driver_version=new, pitstop_config=_drifted_config(fleet))
    rc, out = _playbook(fleet, "rollout.yml")
    assert rc == 0, out[-6000:]
    first, second = fleet.hosts["deb12"], fleet.hosts["deb13"]
    for name, c in fleet.hosts.items():
        assert installed_version(c, DRIVER) == new, name
        assert agent_status(c)["state"] == "ready", name
        # The rollout waited for a snapshot taken after the drift, and checked the canary.
        assert set(_snapshots(c)) - set(old_snapshots[name]), (name, _snapshots(c))
    assert "Wait for a snapshot taken after this host's upgrade began" in out
    assert "Check that the engine gives the recorded answer" in out
    # serial: 1 — the second host's upgrade began after the first host was ready again.
    t1, t2 = dpkg_installed_at(first, DRIVER, new), dpkg_installed_at(second, DRIVER, new)
    assert t1 and t2 and t1 < t2, (t1, t2)
    assert out.count("PLAY [Roll the pinned versions and the agent out]") == 2, out[-3000:]


def test_rollout_stops_at_the_first_failing_host(fleet: Fleet) -> None:
    first, second = fleet.hosts["deb12"], fleet.hosts["deb13"]
    first.run(["touch", FAIL_MARKER])
    before = DRIVER_VERSIONS[1]
    fleet.write_inventory(nvidia_driver_version=DRIVER_VERSIONS[2],
                          pitstop_config=_drifted_config(fleet))
    rc, out = _playbook(fleet, "rollout.yml")
    assert rc != 0, out[-6000:]
    assert "this host is marked to fail" in out, out[-6000:]
    # The second host was never touched: old pin, agent still ready.
    assert installed_version(second, DRIVER) == before
    assert agent_status(second)["state"] == "ready"
    assert recap(out).get("deb13") is None or recap(out)["deb13"]["changed"] == 0, out[-3000:]


KEY = "sk-fleet-test-key-0123456789"
PASSWORD = "fleet-scrape-password"
# From inside the host: its own front and metrics endpoint, through TLS with the test CA.
_ASK = """
import base64, json, os, ssl, sys, urllib.error, urllib.request
ctx = ssl.create_default_context(cadata=sys.stdin.read())
def status(url, auth):
    req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
basic = "Basic " + base64.b64encode(b"prometheus:" + os.environ["PASSWORD"].encode()).decode()
print(json.dumps([status("https://127.0.0.1:8000/v1/models", "Bearer " + os.environ["KEY"]),
                  status("https://127.0.0.1:8000/v1/models", None),
                  status("https://127.0.0.1:9410/metrics", basic),
                  status("https://127.0.0.1:9410/metrics", None)]))
"""


def test_the_role_installs_keys_and_certificates_from_the_inventory(fleet: Fleet) -> None:
    # The pitstop role alone on deb12, with the inventory as the stopped rollout left it
    # (deb12's driver package is marked to fail) plus the secrets; deb13 stays open.
    ca = TestCA(fleet.scratch / "ca", "pitstop fleet test CA")
    front, metrics = ca.issue("front", server=True), ca.issue("metrics", server=True)
    secrets = {
        "pitstop_api_keys": [KEY],
        "pitstop_front_tls_cert": front.cert.read_text(),
        "pitstop_front_tls_key": front.key.read_text(),
        "pitstop_metrics_tls_cert": metrics.cert.read_text(),
        "pitstop_metrics_tls_key": metrics.key.read_text(),
        "pitstop_metrics_basic_auth_users": {
            "prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()},
    }
    fleet.write_inventory(nvidia_driver_version=DRIVER_VERSIONS[2],
                          pitstop_config=_drifted_config(fleet), **secrets)
    play = fleet.scratch / "secrets.yml"
    play.write_text(yaml.safe_dump([{"name": "Give the agent its keys and certificates",
                                     "hosts": "deb12", "become": True,
                                     "roles": ["pitstop"]}]))
    r = run_ansible("ansible-playbook", "-i", str(fleet.inventory), str(play), timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    # no_log: neither the key nor a private key is in what Ansible printed.
    private = front.key.read_text().splitlines()[1]
    assert KEY not in out and private not in out, "a secret is in ansible-playbook's output"
    c = fleet.hosts["deb12"]
    listing = c.run(["stat", "-c", "%n %a %U", "/etc/pitstop/secrets",
                     *(f"/etc/pitstop/secrets/{n}" for n in (
                         "api-keys", "front.crt", "front.key", "metrics.crt", "metrics.key",
                         "web-config.yml"))]).stdout.split("\n")
    assert listing[0] == "/etc/pitstop/secrets 700 root", listing
    assert all(line.endswith(" 600 root") for line in listing[1:] if line), listing
    config = yaml.safe_load(c.run(["cat", "/etc/pitstop/pitstop.yaml"]).stdout)
    assert config["front"]["api_key_file"] == "/etc/pitstop/secrets/api-keys"
    assert config["metrics"]["web_config_file"] == "/etc/pitstop/secrets/web-config.yml"
    st = agent_status(c)
    assert st["state"] == "ready", st
    assert st["front_access"] == {"tls": True, "client_certificates": False, "credentials": 1}
    assert st["metrics_access"] == {"tls": True, "client_certificates": False,
                                    "credentials": 1}
    asked = c.run(["/opt/pitstop/venv/bin/python", "-c", _ASK], input=ca.cert.read_text(),
                  env={"KEY": KEY, "PASSWORD": PASSWORD})
    assert json.loads(asked.stdout) == [200, 401, 200, 401]
    assert KEY not in c.journal("pitstop-agent.service")


def test_report_names_the_hosts_off_the_pins(fleet: Fleet) -> None:
    # After the stopped rollout the inventory pins the third version; deb13 still has the second.
    report = fleet.scratch / "report.json"
    r = run_ansible("ansible-playbook", "-i", str(fleet.inventory), "-e",
                    f"pitstop_report_file={report}", str(ROOT / "playbooks" / "report.yml"),
                    timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    data = json.loads(report.read_text())
    hosts = {h["host"]: h for h in data["hosts"]}
    assert set(hosts) == set(fleet.hosts)
    assert "deb13" in data["differing"], data
    deb13 = hosts["deb13"]
    assert deb13["driver_packages"] == {DRIVER: DRIVER_VERSIONS[1]}
    assert deb13["driver_pin"] == DRIVER_VERSIONS[2]
    assert deb13["kernel"] == os.uname().release == deb13["kernel_pin"]
    assert deb13["agent_state"] == "ready" and deb13["agent_version"]
    assert deb13["engine_kind"] == "reference"
    assert deb13["snapshots"] >= 1 and deb13["snapshot_age_s"] is not None
    # deb12 got keys and certificates from the role; deb13 serves as it was.
    assert data["unauthenticated"] == ["deb13"], data
    assert hosts["deb12"]["unauthenticated"] == []
    assert deb13["unauthenticated"] == [
        "front on 127.0.0.1:8000: no API key, no client certificates, no TLS",
        "metrics on 127.0.0.1:9410: no basic auth, no client certificates, no TLS"]


VLLM_NODE_VENV = "/opt/pitstop-vllm/venv"
HEAVY = {"torch", "numpy", "safetensors", "tokenizers"}


def _pip_list(c: SystemdContainer, venv: str) -> set[str]:
    listed = c.run([f"{venv}/bin/pip", "list", "--format", "json"]).stdout
    # pip spells some names with "_" (prometheus_client): compare them lowered, "-" for "_".
    return {d["name"].lower().replace("_", "-") for d in json.loads(listed)}


def test_a_vllm_node_gets_the_agent_without_torch(fleet: Fleet) -> None:
    # The role's install steps as a vLLM node runs them (engine.kind vllm: pitstop_extras
    # defaults to none), into a virtualenv of their own beside the running reference agent;
    # the last test of deb12, so that nothing after it depends on that host's state.
    c = fleet.hosts["deb12"]
    play = fleet.scratch / "vllm-node.yml"
    play.write_text(yaml.safe_dump([{
        "name": "Install the agent as on a vLLM node",
        "hosts": "deb12",
        "tasks": [{
            "name": "Run the role's install steps",
            "ansible.builtin.include_role": {
                "name": "pitstop", "tasks_from": "install",
                "vars_from": "{{ ansible_facts['os_family'] }}.yml"},
            "vars": {
                "pitstop_venv": VLLM_NODE_VENV,
                # No restart of the reference agent running on this host.
                "pitstop_service_state": "stopped",
                "pitstop_config": {"engine": {"kind": "vllm", "model": "/srv/models/tiny",
                                              "python": "/opt/vllm/bin/python"}},
            },
        }],
    }], sort_keys=False))
    r = run_ansible("ansible-playbook", "-i", str(fleet.inventory), str(play), timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    vllm_node = _pip_list(c, VLLM_NODE_VENV)
    assert "pitstop" in vllm_node and not HEAVY & vllm_node, vllm_node
    # The reference hosts got the reference extra: their engine and make-model need it.
    assert _pip_list(c, "/opt/pitstop/venv") >= HEAVY


# --- a host of two engines: deb13 (deb12 is marked to fail and runs a second venv) ---------
ENGINE_PORTS = {"a": (8001, 9411), "b": (8002, 9412)}


def _engines(**config: object) -> list[dict]:
    return [{"name": n, "gpus": [], "front_port": f, "metrics_port": m, "config": config}
            for n, (f, m) in ENGINE_PORTS.items()]


def _engine_status(c: SystemdContainer, name: str) -> dict:
    r = c.run(["/opt/pitstop/venv/bin/pitstop", "status", "--json", "--engine", name],
              check=False)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {"state": f"no status ({r.stderr.strip()[-200:]})"}


def _times(c: SystemdContainer, name: str) -> dict[str, int]:
    """When the engine's agent last left inactive (a start began), last went inactive (a stop
    ended) and last became active (READY: its canary answered), on the host's monotonic clock."""
    props = ("InactiveExitTimestampMonotonic", "InactiveEnterTimestampMonotonic",
             "ActiveEnterTimestampMonotonic")
    return {k: int(v) for k, v in c.show(f"pitstop-agent@{name}.service", *props).items()}


def _engine_snapshots(c: SystemdContainer, name: str) -> set[str]:
    r = c.run(["sh", "-c", f"ls /var/lib/pitstop/engines/{name}/snapshots/*/manifest.json"],
              check=False)
    return set(r.stdout.split())


def _two_engines_inventory(fleet: Fleet, **engine_config: object) -> None:
    # deb13 keeps the driver it has; deb12 is left out of these runs (--limit deb13).
    fleet.write_inventory(nvidia_driver_version=DRIVER_VERSIONS[1],
                          pitstop_config=_drifted_config(fleet),
                          host_overrides={"deb13": {"pitstop_engines": _engines(**engine_config)}})


def test_a_rollout_turns_a_host_into_two_engines_started_one_after_the_other(
        fleet: Fleet) -> None:
    c = fleet.hosts["deb13"]
    _two_engines_inventory(fleet)
    try:
        rc, out = _playbook(fleet, "rollout.yml", "--limit", "deb13")
    finally:
        fleet.write_inventory()
    assert rc == 0, out[-6000:]
    for name in ENGINE_PORTS:
        assert c.systemctl("is-active", f"pitstop-agent@{name}.service", check=False).strip() \
            == "active", c.journal(f"pitstop-agent@{name}.service")[-3000:]
        assert c.systemctl("is-enabled", f"pitstop-agent@{name}.service").strip() == "enabled"
        assert _engine_status(c, name)["state"] == "ready"
        assert _engine_snapshots(c, name), name
    # The host's one agent gave way to its engines' agents.
    assert c.systemctl("is-enabled", "pitstop-agent.service", check=False).strip() == "disabled"
    assert c.systemctl("is-active", "pitstop-agent.service", check=False).strip() == "inactive"
    # b was started once a was ready.
    assert _times(c, "a")["ActiveEnterTimestampMonotonic"] \
        <= _times(c, "b")["InactiveExitTimestampMonotonic"]
    assert "Verify each engine's canary through its front" in out
    r = c.run(["/opt/pitstop/venv/bin/pitstop", "check-config"])
    assert "2 engines (a, b): no port, directory or GPU memory claimed twice" in r.stdout


def test_a_rollout_restarts_the_engines_one_at_a_time(fleet: Fleet) -> None:
    c = fleet.hosts["deb13"]
    before = {n: _engine_snapshots(c, n) for n in ENGINE_PORTS}
    started = {n: _times(c, n) for n in ENGINE_PORTS}
    # A drift for both engines: new snapshots must be taken after their restarts.
    _two_engines_inventory(fleet, engine={"args": ["--kv-slots", "2"]})
    try:
        rc, out = _playbook(fleet, "rollout.yml", "--limit", "deb13")
    finally:
        fleet.write_inventory()
    assert rc == 0, out[-6000:]
    a, b = _times(c, "a"), _times(c, "b")
    for name, t in (("a", a), ("b", b)):
        assert t["InactiveEnterTimestampMonotonic"] \
            > started[name]["ActiveEnterTimestampMonotonic"], f"engine {name} was not restarted"
        assert _engine_status(c, name)["state"] == "ready"
        assert _engine_snapshots(c, name) - before[name], f"engine {name}: no new snapshot"
    # b stopped only once a was serving again: the host never lost both engines.
    assert a["ActiveEnterTimestampMonotonic"] < b["InactiveEnterTimestampMonotonic"], (a, b)


def test_report_lists_every_engine_of_the_host(fleet: Fleet) -> None:
    report = fleet.scratch / "report-engines.json"
    _two_engines_inventory(fleet, engine={"args": ["--kv-slots", "2"]})
    try:
        r = run_ansible("ansible-playbook", "-i", str(fleet.inventory), "-e",
                        f"pitstop_report_file={report}",
                        str(ROOT / "playbooks" / "report.yml"), timeout=600)
    finally:
        fleet.write_inventory()
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    hosts = {h["host"]: h for h in json.loads(report.read_text())["hosts"]}
    deb13 = hosts["deb13"]
    assert [(e["name"], e["unit"], e["state"]) for e in deb13["engines"]] == [
        ("a", "pitstop-agent@a.service", "ready"), ("b", "pitstop-agent@b.service", "ready")]
    # A host of one engine lists its one agent, unnamed.
    assert [(e["name"], e["unit"]) for e in hosts["deb12"]["engines"]] == \
        [(None, "pitstop-agent.service")]
    assert [e["front"] for e in deb13["engines"]] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    assert all(e["snapshot"] for e in deb13["engines"])
    assert deb13["agent_state"] == "ready" and deb13["snapshots"] >= 2
