"""The real agent (`pitstop run`, reference engine on CPU) under the shipped unit, in systemd.

One container and one agent service for the module; the tests run in order and each leaves
the service active for the next (a failing one is reported, the next starts it again). The
agent finds the project's CRIU (`make criu`) in the repository, which the container sees, so
after its cold start it takes a snapshot, and later starts come back through a full restore.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agent.checkpoint.criu_locate import REPO_WRAPPER
from tests.conftest import cached_model
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
PITSTOP = str(REPO / ".venv" / "bin" / "pitstop")
CONFIG = SCRATCH / "pitstop.yaml"
STATE = Path("/var/lib/pitstop-test")
STATUS = STATE / "run" / "status.json"
# Short enough to keep the hang test quick, long enough that a busy 2-CPU machine does not
# starve a healthy agent past it; the shipped unit says 30 s and 15 s.
TEST_OVERRIDES = "[Service]\nWatchdogSec=8s\nTimeoutAbortSec=3s\n"


def _config(model: Path) -> dict:
    return {
        "engine": {"kind": "reference", "model": str(model), "device": "cpu"},
        "paths": {"state_dir": str(STATE)},
        # The front is the lead's part; the unit mechanics need none.
        "front": {"enabled": False},
        "metrics": {"enabled": False},
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "start_timeout_s": 180},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
    }


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdContainer]:
    missing = container_prerequisites()
    require(not missing, "cannot boot a systemd container: missing " + "; ".join(missing))
    require(REPO_WRAPPER.exists(), f"no CRIU at {REPO_WRAPPER}: run `make criu`")
    model = cached_model("tiny")  # under the repo, which the container sees read-only
    c = make_container(tmp_path_factory.mktemp("sd-agent"),
                       tmp_path_factory.mktemp("sd-agent-logs") / "boot.log")
    c.start()
    try:
        c.write_file(str(CONFIG), yaml.safe_dump(_config(model)))
        # The real holder, on its CPU (memfd) backend: no GPU here.
        c.run([PITSTOP, "install-units", "--config", str(CONFIG), "--holder-backend", "cpu"])
        c.write_file(f"/etc/systemd/system/{AGENT}.d/test.conf", TEST_OVERRIDES)
        c.systemctl("daemon-reload")
        yield c
    finally:
        try:
            print(f"\n--- journal of {AGENT} (tail) ---\n" + c.journal(AGENT)[-3000:])
            c.systemctl("stop", AGENT, check=False, timeout=150)
        finally:
            c.stop()


def _status(c: SystemdContainer) -> dict:
    r = c.run(["cat", str(STATUS)], check=False)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {}


def _active(c: SystemdContainer) -> bool:
    return c.show(AGENT, "ActiveState")["ActiveState"] == "active"


def _recovery(c: SystemdContainer) -> dict:
    return _status(c).get("last_recovery") or {}


def _engine_is_the_agents_child(c: SystemdContainer) -> None:
    """The engine runs under the current agent: not an orphan of an earlier one."""
    engine = _status(c)["engine_pid"]
    ppid = c.run(["ps", "-o", "ppid=", "-p", str(engine)]).stdout.strip()
    assert ppid == c.show(AGENT, "MainPID")["MainPID"], f"engine {engine} has parent {ppid}"


def _ensure_started(c: SystemdContainer) -> None:
    if not _active(c):
        c.systemctl("reset-failed", AGENT, check=False)
        c.systemctl("start", AGENT, timeout=300)


def test_the_agent_is_active_only_after_ready_and_the_canary(agent: SystemdContainer) -> None:
    c = agent
    t0 = time.monotonic()
    c.systemctl("start", "--no-block", AGENT)
    states: set[str] = set()
    canary_at_active: list[bool] = []

    def seen_active() -> bool:
        s = c.show(AGENT, "ActiveState")["ActiveState"]
        states.add(s)
        if s == "active":
            # READY=1 may only come after the canary was answered and recorded.
            canary_at_active.append(c.run(["test", "-s", str(STATE / "canary.json")],
                                          check=False).returncode == 0)
            return True
        assert s == "activating", f"{AGENT} went {s}:\n{c.journal(AGENT)[-3000:]}"
        return False

    c.wait_for(f"{AGENT} active", seen_active, 240, interval_s=0.2)
    print(f"\nagent: cold start, time to READY {time.monotonic() - t0:.2f} s")
    assert "activating" in states
    assert canary_at_active == [True]
    status = _status(c)
    # Serving; right after a cold start it may already be taking the snapshot it lacked.
    assert status["state"] in ("ready", "snapshotting") and status["engine_pid"]
    assert "canary recorded" in c.journal(AGENT)
    out = c.run([PITSTOP, "status", "--config", str(CONFIG)], check=False).stdout
    assert "last recovery: cold (startup) success" in out, out


def test_the_agent_snapshots_its_engine_under_the_unit(agent: SystemdContainer) -> None:
    c = agent
    _ensure_started(c)
    c.wait_for("the first snapshot", lambda: "published" in _status(c).get("reason", ""), 240,
               interval_s=0.5)
    r = c.run([PITSTOP, "snapshot", "list", "--json", "--config", str(CONFIG)])
    assert [s["kind"] for s in json.loads(r.stdout)] == ["full"]


def test_a_killed_engine_is_recovered_without_a_systemd_restart(agent: SystemdContainer) -> None:
    c = agent
    _ensure_started(c)
    before = c.show(AGENT, "MainPID", "NRestarts")
    restarts = _status(c).get("restarts", 0)
    c.run(["kill", "-KILL", str(_status(c)["engine_pid"])])
    # The status file may say ready a moment before it names the recovery: wait for both.
    c.wait_for("the engine recovered",
               lambda: _status(c).get("state") == "ready"
               and _status(c).get("restarts") == restarts + 1
               and _recovery(c).get("cause") == "crash", 240, interval_s=0.2)
    print(f"\nagent: engine SIGKILLed, recovered via {_recovery(c).get('path')} in "
          f"{_recovery(c).get('duration_s')} s")
    assert _recovery(c)["path"] == "full", _recovery(c)
    assert c.show(AGENT, "MainPID", "NRestarts") == before, c.journal(AGENT)[-3000:]
    _engine_is_the_agents_child(c)


def test_a_reload_with_a_broken_config_keeps_the_agent_running(agent: SystemdContainer) -> None:
    c = agent
    _ensure_started(c)
    pid = c.show(AGENT, "MainPID")["MainPID"]
    good = c.run(["cat", str(CONFIG)]).stdout
    try:
        c.write_file(str(CONFIG), good + "\nno_such_key: 1\n")
        c.systemctl("reload", AGENT)
        c.wait_for("the refusal in the journal",
                   lambda: "reload refused" in c.journal(AGENT), 30)
        assert _active(c)
        assert c.show(AGENT, "MainPID")["MainPID"] == pid
        assert "reload refused" in c.show(AGENT, "StatusText")["StatusText"]
    finally:
        c.write_file(str(CONFIG), good)
    c.systemctl("reload", AGENT)
    c.wait_for("the reload", lambda: "configuration reloaded" in c.journal(AGENT), 30)
    assert c.show(AGENT, "MainPID")["MainPID"] == pid


def test_systemctl_restart_comes_back_through_a_restore_and_the_time_is_recorded(
        agent: SystemdContainer) -> None:
    c = agent
    _ensure_started(c)
    old = c.show(AGENT, "MainPID")["MainPID"]
    t0 = time.monotonic()
    # systemctl blocks until the new agent sent READY=1, i.e. until the canary passed.
    c.systemctl("restart", AGENT, timeout=300)
    took = time.monotonic() - t0
    last = _recovery(c)
    print(f"\nagent: systemctl restart -> READY in {took:.2f} s "
          f"(path {last.get('path')}, {last.get('duration_s')} s; stages {last.get('stages')})")
    assert _active(c) and c.show(AGENT, "MainPID")["MainPID"] != old
    assert _status(c)["state"] == "ready"
    assert last["path"] == "full", last
    _engine_is_the_agents_child(c)


def test_a_hung_agent_is_restarted_by_the_watchdog(agent: SystemdContainer) -> None:
    c = agent
    _ensure_started(c)
    before = c.show(AGENT, "MainPID", "NRestarts")
    c.systemctl("kill", "--kill-who=main", "--signal=SIGSTOP", AGENT)
    t0 = time.monotonic()
    c.wait_for("a restart by the watchdog",
               lambda: int(c.show(AGENT, "NRestarts")["NRestarts"]) > int(before["NRestarts"]),
               60)
    c.wait_for("active again", lambda: _active(c), 240, interval_s=0.2)
    print(f"\nagent: hung (SIGSTOP) -> watchdog -> READY again in {time.monotonic() - t0:.2f} s"
          f" via {_recovery(c).get('path')}")
    assert c.show(AGENT, "MainPID")["MainPID"] != before["MainPID"]
    assert "Watchdog timeout" in c.journal(AGENT)
    assert _recovery(c)["path"] == "full", _recovery(c)
    # The hung agent's engine was killed with it (a restore needs its PID free), and the
    # restored one belongs to the new agent.
    _engine_is_the_agents_child(c)


def test_the_real_holder_outlives_agent_restarts_and_stops(agent: SystemdContainer) -> None:
    c = agent
    _ensure_started(c)
    c.systemctl("start", HOLDER)
    holder = c.show(HOLDER, "MainPID", "ActiveState", "NRestarts")
    assert holder["ActiveState"] == "active"
    assert "holding for GPU-test-0" in c.show(HOLDER, "StatusText")["StatusText"]
    c.systemctl("restart", AGENT, timeout=300)
    c.systemctl("stop", AGENT, timeout=300)
    assert c.show(HOLDER, "MainPID", "ActiveState", "NRestarts") == holder
    c.systemctl("start", AGENT, timeout=300)
    assert c.show(HOLDER, "MainPID", "ActiveState", "NRestarts") == holder
    r = c.run([PITSTOP, "holder", "status", "--backend", "cpu", "--gpu", "GPU-test-0",
               "--dir", "/run/pitstop/holder"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    mode = c.run(["stat", "-c", "%a", "/run/pitstop/holder"]).stdout.strip()
    assert mode == "700"


# The shipped unit allows 5 starts in 10 minutes (StartLimitBurst): a sixth agent death in
# that window is a crash loop that systemd stops, on purpose. Four kills stay inside it.
AGENT_KILLS = 4


def test_repeated_sigkills_of_the_agent_are_each_restarted_by_systemd_through_a_restore(
        agent: SystemdContainer) -> None:
    c = agent
    c.systemctl("reset-failed", AGENT, check=False)
    _ensure_started(c)
    c.wait_for("a snapshot", lambda: "published" in _status(c).get("reason", "")
               or _recovery(c).get("path") == "full", 180, interval_s=0.5)
    snapshots = c.run(["ls", str(STATE / "snapshots")]).stdout.split()
    times = []
    for _ in range(AGENT_KILLS):
        before = c.show(AGENT, "MainPID", "NRestarts")
        t0 = time.monotonic()
        c.systemctl("kill", "--kill-who=main", "--signal=SIGKILL", AGENT)
        c.wait_for("a restart", lambda b=before: int(c.show(AGENT, "NRestarts")["NRestarts"])
                   > int(b["NRestarts"]), 60, interval_s=0.2)
        c.wait_for("active again", lambda: _active(c) and _status(c).get("state") == "ready",
                   240, interval_s=0.2)
        times.append(time.monotonic() - t0)
        assert c.show(AGENT, "MainPID")["MainPID"] != before["MainPID"]
        assert _recovery(c)["path"] == "full", _recovery(c)
        _engine_is_the_agents_child(c)
    print(f"\nagent SIGKILLed {AGENT_KILLS} times: back (RestartSec=2s included) in "
          + ", ".join(f"{t:.1f}" for t in times) + " s")
    # No snapshot was lost to the kills (a restore keeps the one it came from).
    after = c.run(["ls", str(STATE / "snapshots")]).stdout.split()
    assert set(snapshots) <= set(after), (snapshots, after)


# --- several engines on the node: pitstop-agent@NAME, one agent each -----------------------
# Last in the module: the one-engine agent above is stopped to leave the CPUs to these two.
ENGINES_DIR = Path("/etc/pitstop/engines")
ENGINES = ("a", "b")
FRONT = {"a": 8101, "b": 8102}
METRICS = {"a": 9511, "b": 9512}


def _unit(name: str) -> str:
    return f"pitstop-agent@{name}.service"


def _engine_state(name: str) -> Path:
    return Path(f"/var/lib/pitstop-test/engines/{name}")


def _engine_config(model: Path, name: str) -> dict:
    return {**_config(model),
            "paths": {"state_dir": str(_engine_state(name))},
            "front": {"host": "127.0.0.1", "port": FRONT[name]},
            "metrics": {"host": "127.0.0.1", "port": METRICS[name]}}


def _estatus(c: SystemdContainer, name: str) -> dict:
    r = c.run(["cat", str(_engine_state(name) / "run" / "status.json")], check=False)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {}


def _http(c: SystemdContainer, url: str, body: dict | None = None) -> str:
    """GET or POST (JSON) from inside the container, with the venv's Python."""
    script = ("import json, sys, urllib.request as u\n"
              "d = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None\n"
              "req = u.Request(sys.argv[1], data=None if d is None else json.dumps(d).encode(),"
              " headers={'Content-Type': 'application/json'})\n"
              "print(u.urlopen(req, timeout=60).read().decode())\n")
    argv = [str(REPO / ".venv" / "bin" / "python"), "-c", script, url]
    return c.run(argv + ([json.dumps(body)] if body is not None else []), timeout=90).stdout


def _serves(c: SystemdContainer, name: str) -> str:
    """One completion through the engine's front; its text."""
    model = cached_model("tiny").name
    out = _http(c, f"http://127.0.0.1:{FRONT[name]}/v1/completions",
                {"model": model, "prompt": "Two engines", "max_tokens": 4, "temperature": 0})
    return json.loads(out)["choices"][0]["text"]


def _snapshot_ids(c: SystemdContainer, name: str) -> set[str]:
    r = c.run([PITSTOP, "snapshot", "list", "--json", "--engine", name])
    return {s["id"] for s in json.loads(r.stdout)}


def _restored_ids(c: SystemdContainer, name: str) -> list[str]:
    """The snapshots the engine's agent restored, as its journal says, oldest first."""
    return re.findall(r"restored snapshot (\S+) as PID", c.journal(_unit(name)))


def _next_restored(c: SystemdContainer, name: str, seen: int) -> str:
    """The snapshot of the restore after the first `seen` ones; journald may write the line a
    moment after the agent said ready."""
    c.wait_for(f"engine {name}'s restore in its journal",
               lambda: len(_restored_ids(c, name)) > seen, 30, interval_s=0.2)
    return _restored_ids(c, name)[seen]


@pytest.fixture(scope="module")
def engines(agent: SystemdContainer) -> Iterator[SystemdContainer]:
    """Engines a and b, each with its own file, ports and state, both ready with a snapshot."""
    c = agent
    c.systemctl("stop", AGENT, timeout=300)
    model = cached_model("tiny")
    for name in ENGINES:
        c.write_file(str(ENGINES_DIR / f"{name}.yaml"),
                     yaml.safe_dump(_engine_config(model, name)))
    try:
        r = c.run([PITSTOP, "check-config"])
        assert "2 engines (a, b): no port, directory or GPU memory claimed twice" in r.stdout
        out = c.run([PITSTOP, "install-units", "--config", str(CONFIG), "--holder-backend",
                     "cpu", "--enable"]).stdout
        assert f"enable {_unit('a')} {_unit('b')}" in out, out
        # systemctl returns once both sent READY=1: each one's canary answered.
        c.systemctl("start", _unit("a"), _unit("b"), timeout=400)
        for name in ENGINES:
            c.wait_for(f"engine {name}'s first snapshot",
                       lambda n=name: "published" in _estatus(c, n).get("reason", ""), 300,
                       interval_s=0.5)
        yield c
    finally:
        for name in ENGINES:
            print(f"\n--- journal of {_unit(name)} (tail) ---\n" + c.journal(_unit(name))[-2000:])
        c.systemctl("stop", _unit("a"), _unit("b"), check=False, timeout=300)


def test_each_engine_has_its_own_unit_directories_ports_and_label(
        engines: SystemdContainer) -> None:
    c = engines
    for name in ENGINES:
        assert c.show(_unit(name), "ActiveState")["ActiveState"] == "active"
        st = _estatus(c, name)
        assert st["engine"] == name and st["front"] == f"127.0.0.1:{FRONT[name]}"
        # Every metric the agent serves says which engine it is.
        text = _http(c, f"http://127.0.0.1:{METRICS[name]}/metrics")
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert samples and all(f'engine="{name}"' in line for line in samples), samples[:5]
    assert _snapshot_ids(c, "a").isdisjoint(_snapshot_ids(c, "b"))
    listing = c.run([PITSTOP, "status"], check=False).stdout
    assert "engine a\n  state:    ready" in listing and "engine b\n  state:    ready" in listing


@pytest.mark.parametrize(("killed", "other"), [("a", "b"), ("b", "a")])
def test_each_engine_sigkilled_comes_back_from_its_own_snapshot_while_the_other_serves(
        engines: SystemdContainer, killed: str, other: str) -> None:
    c = engines
    other_before = (_estatus(c, other)["engine_pid"], c.show(_unit(other), "MainPID"))
    restarts = _estatus(c, killed)["restarts"]
    restored = len(_restored_ids(c, killed))
    c.run(["kill", "-KILL", str(_estatus(c, killed)["engine_pid"])])
    # While `killed` recovers, `other` answers, through the same engine process as before.
    assert _serves(c, other)
    c.wait_for(f"engine {killed} recovered",
               lambda: _estatus(c, killed).get("state") == "ready"
               and _estatus(c, killed).get("restarts") == restarts + 1, 240, interval_s=0.2)
    rec = _estatus(c, killed)["last_recovery"]
    print(f"\nengine {killed} SIGKILLed: back via {rec['path']} in {rec['duration_s']:.2f} s; "
          f"engine {other} served meanwhile")
    assert (rec["path"], rec["cause"]) == ("full", "crash"), rec
    assert _next_restored(c, killed, restored) in _snapshot_ids(c, killed)
    assert (_estatus(c, other)["engine_pid"], c.show(_unit(other), "MainPID")) == other_before
    assert _estatus(c, other)["state"] in ("ready", "snapshotting")
    assert _serves(c, killed) and _serves(c, other)


def test_systemctl_restart_of_one_engine_leaves_the_other_serving(
        engines: SystemdContainer) -> None:
    c = engines
    b_before = (_estatus(c, "b")["engine_pid"], c.show(_unit("b"), "MainPID"))
    a_agent = c.show(_unit("a"), "MainPID")
    restored = len(_restored_ids(c, "a"))
    # Returns once the new agent of a sent READY=1.
    c.systemctl("restart", _unit("a"), timeout=300)
    assert c.show(_unit("a"), "MainPID") != a_agent
    rec = _estatus(c, "a")["last_recovery"]
    assert rec["path"] == "full", rec
    assert _next_restored(c, "a", restored) in _snapshot_ids(c, "a")
    assert (_estatus(c, "b")["engine_pid"], c.show(_unit("b"), "MainPID")) == b_before
    assert _serves(c, "b") and _serves(c, "a")
