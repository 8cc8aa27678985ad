"""Process trees: orphans come back to the subreaper and are reaped; trees die whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_an_orphaned_grandchild_is_reparented_to_the_subreaper_and_reaped():
    r = _run("""
        import os, subprocess, time
        from agent import proc
        proc.become_subreaper()
        # The shell starts a grandchild and exits at once: the grandchild is orphaned.
        sh = subprocess.Popen(["sh", "-c", "sleep 0.3 & echo $!"], stdout=subprocess.PIPE)
        grandchild = int(sh.stdout.read())
        sh.wait()
        assert grandchild in proc.children_of(os.getpid()), "not re-parented to us"
        deadline = time.time() + 10
        reaped = []
        while time.time() < deadline and grandchild not in [p for p, _ in reaped]:
            reaped += proc.reap_orphans()
            time.sleep(0.05)
        assert grandchild in [p for p, _ in reaped], reaped
        assert grandchild not in proc.children_of(os.getpid())
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_the_reaper_leaves_owned_children_to_their_owner():
    r = _run("""
        import os, subprocess, time
        from agent import proc
        with proc.spawn_lock():
            p = subprocess.Popen(["true"])
            proc.own(p.pid)
        time.sleep(0.3)
        assert proc.reap_orphans() == []
        assert p.wait() == 0  # the owner still gets the real status
        print("ok")
    """)
    assert r.returncode == 0, r.stderr


def test_kill_tree_kills_every_descendant_even_in_other_sessions():
    r = _run("""
        import os, subprocess, time
        from agent import proc
        proc.become_subreaper()
        p = subprocess.Popen(["sh", "-c", "setsid sleep 60 & sleep 60 & wait"])
        time.sleep(0.5)
        tree = proc.descendants(p.pid)
        assert len(tree) == 2, tree
        proc.kill_tree(p.pid)
        p.wait()
        deadline = time.time() + 5
        while time.time() < deadline and any(proc.pid_alive(t) for t in tree):
            proc.reap_orphans(); time.sleep(0.05)
        assert not any(proc.pid_alive(t) for t in tree)
        print("ok")
    """)
    assert r.returncode == 0, r.stderr


def test_a_command_with_spaces_and_parens_in_its_name_is_parsed():
    p = subprocess.Popen(["sh", "-c", "exec -a 'we ird) (name' sleep 5"])
    try:
        time.sleep(0.2)
        from agent import proc

        assert p.pid in proc.children_of(__import__("os").getpid())
    finally:
        p.kill()
        p.wait()


def test_an_exited_session_leaders_pid_stays_taken_until_its_group_is_gone():
    # What blocked a restore of vLLM at 32 GiB: the API server (the image's root, leader of
    # the engine's session and group) was reaped, its engine core was still exiting, and
    # CRIU could not fork the root again: "Can't fork for PID: File exists".
    r = _run("""
        import os, signal, subprocess, time
        from agent import proc
        proc.become_subreaper()
        leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"],
                                  stdout=subprocess.PIPE, start_new_session=True)
        member = int(leader.stdout.readline())
        assert proc.ids_in_use([leader.pid]) == {leader.pid: leader.pid}
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        assert not proc.pid_alive(leader.pid)
        # Gone and reaped, yet its ID is the group and session of the member left.
        assert proc.ids_in_use([leader.pid]) == {leader.pid: member}
        os.kill(member, signal.SIGKILL)
        # Dead, not yet reaped: the member is a zombie (this subreaper's child, unwaited).
        deadline = time.monotonic() + 10
        while (st := proc.stat(member)) is not None and st.state != "Z":
            assert time.monotonic() < deadline, "the member did not die"
            time.sleep(0.02)
        assert st is not None, "reaped by someone else"
        # A zombie still holds it: only the reap frees the ID.
        assert proc.ids_in_use([leader.pid]) == {leader.pid: member}, "freed before reaped"
        proc.reap_orphans()
        assert proc.ids_in_use([leader.pid]) == {}
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_threads_id_is_in_use():
    r = _run("""
        import os, threading
        from agent import proc
        got, done = [], threading.Event()
        t = threading.Thread(target=lambda: (got.append(threading.get_native_id()), done.wait()))
        t.start()
        while not got:
            pass
        assert proc.ids_in_use([got[0]]) == {got[0]: os.getpid()}
        done.set(); t.join()
        print("ok")
    """)
    assert r.returncode == 0, r.stderr


def test_killing_an_engine_returns_once_its_whole_group_is_gone():
    r = _run("""
        import asyncio, os, subprocess
        from agent import proc
        from agent.engines.base import LaunchSpec
        from agent.supervisor.engine import EngineProcess
        proc.become_subreaper()
        async def main():
            # A root with a member in its group: SIGKILLed with it, the member is our zombie
            # (re-parented to the subreaper) until reaped, and holds the root's ID till then.
            eng = EngineProcess.spawn(LaunchSpec(argv=["sh", "-c", "sleep 60 & wait"], env={},
                                                 socket=None))
            await asyncio.sleep(0.5)
            await eng.kill()
            held = proc.ids_in_use([eng.pid])
            assert held == {}, held
            await eng.close()
        asyncio.run(main())
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_exits_returns_when_the_process_exits_and_says_when_none_was_running():
    r = _run("""
        import asyncio, os, signal, subprocess
        from agent import proc
        async def main():
            p = subprocess.Popen(["sleep", "60"])
            waiter = asyncio.ensure_future(proc.exits([p.pid], 60))
            await asyncio.sleep(0.2)
            assert not waiter.done()  # it waits while the process runs
            os.kill(p.pid, signal.SIGKILL)
            assert await asyncio.wait_for(waiter, 10) is True
            # Exited, not yet reaped (a zombie), then reaped: nothing left to wait for.
            assert await proc.exits([p.pid], 60) is False
            p.wait()
            assert await proc.exits([p.pid], 60) is False
        asyncio.run(main())
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_kill_waits_for_the_groups_last_member_on_its_exit_not_on_a_timer():
    # A member that left the engine's group keeps its session, so its ID: the kill must
    # wait for it. It is woken by the member's exit (a pidfd), not by polling /proc.
    r = _run("""
        import asyncio, os, signal, subprocess, sys
        from agent import proc
        from agent.engines.base import LaunchSpec
        from agent.supervisor.engine import EngineProcess
        proc.become_subreaper()
        code = "import os, time; os.setpgid(0, 0); print(os.getpid(), flush=True); time.sleep(60)"
        async def main():
            eng = EngineProcess.spawn(LaunchSpec(argv=[
                "sh", "-c", f"{sys.executable} -c '{code}' & wait"], env={}, socket=None))
            while not (member := [p for p in proc.id_holders(eng.pid) if p != eng.pid
                                  and proc.stat(p).pgid != eng.pid]):
                await asyncio.sleep(0.05)
            sleeps = []
            real_sleep = asyncio.sleep
            async def counted(delay, *a, **k):
                sleeps.append(delay)
                return await real_sleep(delay, *a, **k)
            asyncio.sleep = counted
            try:
                kill = asyncio.ensure_future(eng.kill())
                await real_sleep(0.5)
                assert not kill.done(), "returned while a member held the session's ID"
                os.kill(member[0], signal.SIGKILL)
                await asyncio.wait_for(kill, 10)
            finally:
                asyncio.sleep = real_sleep
            assert proc.ids_in_use([eng.pid]) == {}
            assert sleeps == [], f"polled: {sleeps}"
            await eng.close()
        asyncio.run(main())
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
