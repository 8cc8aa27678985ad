"""The standby rung through the real agent, real CRIU and the reference engine."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.agentproc import RunningAgent, agent_config, complete, fallthroughs, snapshot_list
from tests.holder_proc import Holder, wait_for
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required

pytestmark = pytest.mark.integration

NSINIT = "agent.checkpoint.nsinit"


def _standbys(agent_pid: int) -> list[int]:
    """The standby's init processes under the agent (`python -m agent.checkpoint.nsinit`)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        # The deathsig wrapper execs it: its parent is the agent.
        if ppid == agent_pid and NSINIT.encode() in cmd:
            found.append(int(d.name))
    return found


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _run_state(pid: int) -> str:
    """R, S, T (stopped), ... from /proc/PID/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _armed(a: RunningAgent, timeout: float = 120, how: str = "stopped") -> tuple[int, int]:
    """(the standby's init on the host, PID 1 of its namespace) once the agent logged it
    armed (`how`: stopped, or woken); a standby that was continued is the serving engine,
    not a standby."""
    found: list[tuple[int, int]] = []

    def ready() -> bool:
        log = a.log()
        for init in set(_standbys(a.proc.pid)) - {a.status().get("engine_pid")}:
            for ns_init in _children(init):
                if any(f"(root PID {root}, {how}" in log for root in _children(ns_init)):
                    found.append((init, ns_init))
                    return True
        return False
    wait_for(ready, "the standby armed", timeout=timeout)
    return found[0]


def kill_and_expect_hybrid(a: RunningAgent, standby_fell: tuple[str, str]) -> dict:
    """SIGKILL the engine; the recovery must be the hybrid rung's, the standby passed over
    (and nothing else) as `standby_fell` says: (how, refusal code). The recovery."""
    restarts = a.status()["restarts"]
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    rec = a.wait_recovered(restarts + 1)["last_recovery"]
    assert rec["path"] == "hybrid", (rec, a.log_tail(3000))
    codes = {(f["path"], f["kind"]): f["refusal"]["code"] for f in rec["fallthroughs"]}
    assert codes == {("standby", standby_fell[0]): standby_fell[1]}, fallthroughs(rec)
    return rec


def kill_and_expect_standby(a: RunningAgent, init: int) -> dict:
    """SIGKILL the engine; the recovery must be the standby's, with no restore after the
    crash (the copy was restored before it), and the engine now its init's. The recovery."""
    restarts = a.status()["restarts"]
    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    st = a.wait_recovered(restarts + 1)
    rec = st["last_recovery"]
    assert rec["path"] == "standby", (rec, a.log_tail(3000))
    assert "criu_restore" not in rec["stages"], rec
    assert "verify" in rec["stages"] and "resume" in rec["stages"], rec
    assert st["engine_pid"] == init
    return rec


@pytest.fixture(scope="module")
def standby(tmp_path_factory, tiny_model):
    """A cpu-backend holder and an agent with snapshots.standby on, its first hybrid
    snapshot published and a standby armed from it; one for the module."""
    tmp = tmp_path_factory.mktemp("standby")
    holder = Holder(tmp / "holder")
    a = RunningAgent(tmp, agent_config(
        tmp, tiny_model, holder={"enabled": True, "dir": str(tmp / "holder"), "gpu": "cpu"},
        snapshots={"standby": True}))
    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        yield a
    finally:
        a.stop()
        holder.stop()


def test_a_sigkill_is_answered_by_continuing_the_standby(standby):
    a = standby
    before = complete(a)
    init, _ = _armed(a)
    # An operator sees it armed, of the snapshot just published.
    facts = a.wait_for(lambda s: (s.get("standby") or {}).get("armed"), 30,
                       "the status saying the standby is armed")["standby"]
    assert facts["snapshot"] in {x["id"] for x in snapshot_list(a)}, facts
    assert facts["why_none"] == "", facts
    assert a.metric("pitstop_standby_armed") == 1.0
    rec = kill_and_expect_standby(a, init)
    # Only continued: no restore after the crash.
    assert "standby_continue" in rec["stages"], rec
    assert complete(a) == before
    a.logged("held weights re-attached at the same addresses")
    # The reference engine keeps its KV pool in the holder, claimed by one process at a
    # time: the standby waited for the dead engine's tree to be gone.
    assert "torn down while the standby rung is tried" not in a.log()


def test_a_woken_standby_runs_before_the_crash_and_answers_it(tmp_path, tiny_model):
    holder = Holder(tmp_path / "holder")
    a = RunningAgent(tmp_path, agent_config(
        tmp_path, tiny_model, holder={"enabled": True, "dir": str(tmp_path / "holder"),
                                      "gpu": "cpu"},
        snapshots={"standby": True, "standby_woken": True}))
    try:
        a.wait_ready()
        before = complete(a)
        init, ns_init = _armed(a, how="woken")
        # Woken ahead: its processes run (idle) before any crash, none of them stopped.
        copy = [p for root in _children(ns_init) for p in [root, *_children(root)]]
        assert copy and all(_run_state(p) != "T" for p in copy), [
            (p, _run_state(p)) for p in copy]
        kill_and_expect_standby(a, init)
        assert complete(a) == before
    finally:
        a.stop()
        holder.stop()


def test_a_standby_apart_from_the_dead_tree_serves_while_it_goes(tmp_path, tiny_model):
    # The KV pool the engine's own (--no-keep-kv), on a CPU: nothing of the dead engine's
    # is in the standby's way, so it is tried while the dead tree is torn down.
    holder = Holder(tmp_path / "holder")
    a = RunningAgent(tmp_path, agent_config(
        tmp_path, tiny_model, holder={"enabled": True, "dir": str(tmp_path / "holder"),
                                      "gpu": "cpu"},
        engine={"args": ["--no-keep-kv"]}, snapshots={"standby": True, "standby_woken": True}))
    try:
        a.wait_ready()
        before = complete(a)
        init, _ = _armed(a, how="woken")
        dead = a.status()["engine_pid"]
        kill_and_expect_standby(a, init)
        assert f"engine {dead}: its tree is torn down while the standby rung is tried" in a.log()
        assert complete(a) == before
        wait_for(lambda: not Path(f"/proc/{dead}").exists(), "the dead engine reaped")

        # The engine now serving lives in the standby's namespaces; its own root's death is
        # told by the namespace's init at once (how it ended, not the init's exit status),
        # and the next standby answers it.
        ns_init = _children(init)[0]
        root = _children(ns_init)[0]
        init2, _ = _armed(a, how="woken")
        restarts = a.status()["restarts"]
        os.kill(root, signal.SIGKILL)
        st = a.wait_recovered(restarts + 1)
        assert st["last_recovery"]["path"] == "standby", st["last_recovery"]
        assert st["engine_pid"] == init2
        assert f"engine {init} killed by SIGKILL" in a.log(), a.log_tail(3000)
        assert complete(a) == before
        # Its namespace goes with it: the init and its PID 1 are reaped behind.
        wait_for(lambda: not Path(f"/proc/{init}").exists()
                 and not Path(f"/proc/{ns_init}").exists(), "the dead namespace reaped")
    finally:
        a.stop()
        holder.stop()


def test_a_snapshot_of_an_engine_continued_from_the_standby_fails_and_it_serves_on(standby):
    a = standby
    # The engine serving now came from the standby (the test above): it lives in the
    # standby's namespaces, which CRIU does not dump; the snapshot it had stays the one.
    assert a.status()["last_recovery"]["path"] == "standby"
    before, snapshots = complete(a), {x["id"] for x in snapshot_list(a)}
    done = a.pitstop("snapshot", "create")
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert {x["id"] for x in snapshot_list(a)} == snapshots
    assert a.wait_for(lambda s: s.get("state") == "ready", 60, "serving again")
    assert complete(a) == before


def test_a_crash_before_the_next_standby_is_armed_takes_the_hybrid_rung(standby):
    a = standby
    before = complete(a)
    # The engine serving now may be the standby continued: what follows it is restored in
    # the background; here it is gone before the crash.
    init, _ = _armed(a)
    os.kill(init, signal.SIGKILL)
    wait_for(lambda: "standby: the standby (PID" in a.log(), "the standby's death noticed")
    kill_and_expect_hybrid(a, ("skipped", "standby_not_armed"))
    assert complete(a) == before


def test_a_standby_that_cannot_resume_falls_through_to_hybrid(standby, tmp_path):
    a = standby
    before = complete(a)
    _, ns_init = _armed(a)
    # The holder's socket hidden in the standby's mount namespace only: its resume cannot
    # map the held weights; the live engine and the hybrid rung still reach the holder.
    holder_dir = Path(a.config["holder"]["dir"])
    subprocess.run(["nsenter", "-t", str(ns_init), "-m", "mount", "-t", "tmpfs", "tmpfs",
                    str(holder_dir)], check=True)
    kill_and_expect_hybrid(a, ("start_failed", "standby_failed"))
    assert complete(a) == before
