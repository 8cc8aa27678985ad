"""The shipped units under a real systemd (nspawn container), driven by a stand-in notify program.

The stand-in (tests/sd_notify_prog.py) pins the unit mechanics: Type=notify activation, the
watchdog, reload, the draining stop with KillMode=mixed, holders outliving the agent. The
real agent under these units is tested in test_systemd_agent.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prereq import require
from tests.systemd_container import (
    REPO,
    SCRATCH,
    SystemdContainer,
    container_prerequisites,
    make_container,
)

pytestmark = pytest.mark.integration

AGENT = "pitstop-agent.service"
HOLDER = "pitstop-holder@GPU-test-0.service"
PITSTOP = REPO / ".venv" / "bin" / "pitstop"
STAND_IN = SCRATCH / "fake-pitstop"
CONFIG = SCRATCH / "pitstop.yaml"
EVENTS = SCRATCH / "events"
# Small enough to keep the watchdog test short; the shipped default is 30 s.
TEST_WATCHDOG = "WatchdogSec=3s\n"


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdContainer]:
    missing = container_prerequisites()
    require(not missing, "cannot boot a systemd container: missing " + "; ".join(missing))
    scratch = tmp_path_factory.mktemp("sd-scratch")
    logs = tmp_path_factory.mktemp("sd-logs")
    c = make_container(scratch, logs / "boot.log")
    t0 = time.monotonic()
    c.start()
    print(f"\ncontainer {c.name} booted to 'running' in {time.monotonic() - t0:.2f} s")
    try:
        yield c
    finally:
        c.stop()


def _install(c: SystemdContainer, pitstop: Path, config: Path, *extra: str) -> str:
    return c.run([str(PITSTOP), "install-units", "--pitstop-bin", str(pitstop),
                  "--config", str(config), *extra]).stdout


@pytest.fixture
def stand_in(container: SystemdContainer) -> Iterator[SystemdContainer]:
    """Units installed with the stand-in as `pitstop`; everything stopped and removed after."""
    c = container
    c.write_file(str(STAND_IN), "#!/bin/sh\n"
                 f"exec {REPO}/.venv/bin/python {REPO}/tests/sd_notify_prog.py \"$@\"\n", 0o755)
    c.write_file(str(CONFIG), "engine: {model: /nowhere}\n")
    c.write_file(str(SCRATCH / "stand-in.json"),
                 json.dumps({"ready_after_s": 2, "events": str(EVENTS)}))
    c.run(["rm", "-f", str(EVENTS)])
    _install(c, STAND_IN, CONFIG)
    try:
        yield c
    finally:
        c.systemctl("stop", AGENT, "pitstop-holder@*.service", check=False)
        c.systemctl("reset-failed", check=False)
        c.sh("rm -rf /etc/systemd/system/pitstop-* /etc/systemd/system/*.wants/pitstop-*"
             " && systemctl daemon-reload")


def _events(c: SystemdContainer) -> list[tuple[int, str]]:
    text = c.run(["cat", str(EVENTS)], check=False).stdout
    return [(int(p), e) for p, e in (line.split(" ", 1) for line in text.splitlines())]


def _drop_in(c: SystemdContainer, unit: str, body: str) -> None:
    c.write_file(f"/etc/systemd/system/{unit}.d/test.conf", "[Service]\n" + body)
    c.systemctl("daemon-reload")


def test_every_unit_passes_systemd_analyze_verify(container: SystemdContainer) -> None:
    c = container
    out = _install(c, PITSTOP, REPO / "examples" / "pitstop.yaml", "--enable",
                   "--holder", "GPU-test-0")
    assert "systemctl enable" in out
    try:
        # A template is verified through an instance of it.
        r = c.run(["systemd-analyze", "verify", f"/etc/systemd/system/{AGENT}",
                   "/etc/systemd/system/pitstop-agent@a.service",
                   "/etc/systemd/system/pitstop-holders.target",
                   f"/etc/systemd/system/{HOLDER}"], check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        # verify is quiet when all is well: any line is a warning worth fixing.
        assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stderr
        assert c.systemctl("is-enabled", AGENT).strip() == "enabled"
        assert c.systemctl("is-enabled", HOLDER).strip() == "enabled"
    finally:
        c.systemctl("disable", AGENT, "pitstop-holders.target", HOLDER, check=False)
        c.sh("rm -f /etc/systemd/system/pitstop-* && systemctl daemon-reload")


def test_tmpfiles_and_sysctl_snippets_are_installed_private(container: SystemdContainer) -> None:
    c = container
    cfg = SCRATCH / "paths.yaml"
    c.write_file(str(cfg), "engine: {model: /nowhere}\n"
                 "paths: {state_dir: /var/lib/pt-test, run_dir: /run/pt-test}\n")
    _install(c, PITSTOP, cfg)
    modes = c.run(["stat", "-c", "%a %U %n", "/var/lib/pt-test", "/var/lib/pt-test/snapshots",
                   "/run/pt-test"]).stdout.split("\n")
    assert [m.split()[0:2] for m in modes if m] == [["700", "root"]] * 3
    sysctl = c.run(["cat", "/etc/sysctl.d/99-pitstop.conf"]).stdout
    assert "kernel.io_uring_disabled = 2" in sysctl
    c.sh("rm -rf /etc/systemd/system/pitstop-* /etc/tmpfiles.d/pitstop.conf "
         "/etc/sysctl.d/99-pitstop.conf /var/lib/pt-test /run/pt-test")


def test_agent_is_active_only_after_ready(stand_in: SystemdContainer) -> None:
    c = stand_in
    t0 = time.monotonic()
    c.systemctl("start", "--no-block", AGENT)
    c.wait_for("the stand-in to start", lambda: _events(c) != [], 30)
    # Started but not READY yet: systemd must keep it 'activating'.
    assert c.show(AGENT, "ActiveState")["ActiveState"] == "activating"
    took = c.wait_for("active", lambda: c.show(AGENT, "ActiveState")["ActiveState"] == "active",
                      60)
    elapsed = time.monotonic() - t0
    print(f"\nstand-in: time to READY (start --no-block to active) {elapsed:.2f} s")
    assert elapsed >= 2.0 - 0.1, took
    assert [e for _, e in _events(c)][-1] == "ready"
    assert c.show(AGENT, "StatusText")["StatusText"] == "ready (stand-in)"


def test_hung_agent_is_killed_by_the_watchdog_and_restarted(stand_in: SystemdContainer) -> None:
    c = stand_in
    _drop_in(c, AGENT, TEST_WATCHDOG)
    c.systemctl("start", AGENT)
    before = c.show(AGENT, "MainPID", "NRestarts")
    assert before["NRestarts"] == "0"
    engine = next(p for p, e in _events(c) if e == "engine-up")
    c.systemctl("kill", "--kill-who=main", "--signal=SIGSTOP", AGENT)
    t0 = time.monotonic()
    c.wait_for("a restart by the watchdog",
               lambda: c.show(AGENT, "NRestarts")["NRestarts"] == "1", 60)
    c.wait_for("active again",
               lambda: c.show(AGENT, "ActiveState")["ActiveState"] == "active", 60)
    print(f"\nwatchdog: hung at SIGSTOP, active again after {time.monotonic() - t0:.2f} s")
    after = c.show(AGENT, "MainPID")
    assert after["MainPID"] != before["MainPID"]
    assert "Watchdog timeout" in c.journal(AGENT)
    # KillMode=mixed: the hung agent's engine went with it (SIGKILL to the whole cgroup).
    assert c.run(["kill", "-0", str(engine)], check=False).returncode != 0


def test_stop_lets_the_agent_drain_and_stop_its_engine(stand_in: SystemdContainer) -> None:
    c = stand_in
    c.systemctl("start", AGENT)
    agent_pid = int(c.show(AGENT, "MainPID")["MainPID"])
    c.systemctl("stop", AGENT)
    events = _events(c)
    kinds = [e for _, e in events]
    # KillMode=mixed: SIGTERM reached the agent only; the engine was stopped by the agent.
    assert "engine-got-sigterm" not in kinds, events
    assert "engine-stopped-by-agent" in kinds, events
    assert (agent_pid, "draining") in events and (agent_pid, "stopped") in events
    assert c.show(AGENT, "Result")["Result"] == "success"


def test_reload_signals_the_running_agent(stand_in: SystemdContainer) -> None:
    c = stand_in
    c.systemctl("start", AGENT)
    pid = int(c.show(AGENT, "MainPID")["MainPID"])
    c.systemctl("reload", AGENT)
    c.wait_for("the reload event", lambda: (pid, "reload") in _events(c), 10)
    assert int(c.show(AGENT, "MainPID")["MainPID"]) == pid
    assert c.show(AGENT, "ActiveState")["ActiveState"] == "active"


def test_holders_outlive_agent_restarts_and_stops(stand_in: SystemdContainer) -> None:
    c = stand_in
    c.systemctl("start", HOLDER)
    c.systemctl("start", AGENT)
    holder = c.show(HOLDER, "MainPID", "ActiveState", "NRestarts")
    assert holder["ActiveState"] == "active"
    c.systemctl("restart", AGENT)
    c.systemctl("stop", AGENT)
    c.systemctl("start", AGENT)
    assert c.show(HOLDER, "MainPID", "ActiveState", "NRestarts") == holder
    # And the agent's start pulled in the target every enabled holder hangs off.
    assert c.show("pitstop-holders.target", "ActiveState")["ActiveState"] == "active"


def _criu_argv() -> list[str] | None:
    """CRIU >= 4.2 through the project's wrapper (`make criu`); the container sees the repo."""
    wrapper = REPO / ".cache" / "criu" / "bin" / "criu"
    return [str(wrapper)] if wrapper.exists() else None


def test_criu_dumps_and_restores_across_invocations_of_the_agent_unit(
        stand_in: SystemdContainer) -> None:
    """The hardening of pitstop-agent.service leaves CRIU working, restart after restart."""
    c = stand_in
    criu = _criu_argv()
    require(criu, "no CRIU >= 4.2 at .cache/criu/bin/criu (`make criu` installs it)")
    prog = SCRATCH / "criu-pitstop"
    events, count = SCRATCH / "criu-events", SCRATCH / "count"
    c.write_file(str(prog), "#!/bin/sh\n"
                 f"exec {REPO}/.venv/bin/python {REPO}/tests/sd_criu_prog.py \"$@\"\n", 0o755)
    c.write_file(str(SCRATCH / "stand-in.json"), json.dumps(
        {"criu": criu, "images": str(SCRATCH / "img"), "events": str(events),
         "count": str(count)}))
    c.run(["rm", "-rf", str(events), str(count), str(SCRATCH / "img")])
    _install(c, prog, CONFIG)

    def counted() -> int:
        # The loop rewrites the file (truncate, write): an empty read is retried.
        for _ in range(50):
            text = c.run(["cat", str(count)], check=False).stdout.strip()
            if text.isdigit():
                return int(text)
            time.sleep(0.02)
        return 0

    def last_event() -> str:
        return c.run(["tail", "-n1", str(events)], check=False).stdout.strip()

    c.systemctl("start", AGENT)
    engine = last_event().split()[-1]
    assert last_event() == f"spawned {engine}"
    for cycle in range(2):
        c.wait_for("the engine counting", lambda: counted() >= 3, 30)
        c.systemctl("stop", AGENT)
        assert last_event() == f"dumped {engine}", c.journal(AGENT)[-2000:]
        at_dump = counted()
        c.systemctl("start", AGENT, check=False)
        assert last_event() == f"restored {engine}", c.journal(AGENT)[-3000:]
        # The same process, its memory intact: the count goes on from where it stopped (a new
        # process would start again from 1).
        seen: list[int] = []
        c.wait_for("the count to move",
                   lambda n=at_dump, seen=seen: seen.append(counted()) or seen[-1] != n, 30)
        assert at_dump < seen[-1] < at_dump + 100, f"cycle {cycle}: the count restarted"
        group = c.show(AGENT, "ControlGroup")["ControlGroup"]
        cgroups = c.run(["cat", f"/proc/{engine}/cgroup"]).stdout
        assert group in cgroups, f"restored engine outside {group}: {cgroups}"

