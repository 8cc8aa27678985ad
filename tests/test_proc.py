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
