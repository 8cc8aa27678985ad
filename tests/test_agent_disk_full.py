"""A full snapshot file system through the real agent: a crash is still restored from disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench.chaos import fill_until_full
from tests.agentproc import REPO, RunningAgent, agent_config, complete, snapshot_list
from tests.prereq import require
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required

pytestmark = pytest.mark.integration


@pytest.fixture
def small_fs(tmp_path):
    """A 600 MiB tmpfs of the test's own: room for one image of the reference engine."""
    fs = tmp_path / "fs"
    fs.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600m,mode=0700", "pitstop-test",
                        str(fs)], capture_output=True, text=True)
    require(r.returncode == 0, f"cannot mount a tmpfs (needs CAP_SYS_ADMIN): {r.stderr}")
    yield fs
    subprocess.run(["umount", "-l", str(fs)], check=False)


def test_a_crash_while_the_snapshot_disk_is_full_is_restored_and_the_snapshot_kept(
        tmp_path, tiny_model, small_fs):
    a = RunningAgent(tmp_path, agent_config(
        tmp_path, tiny_model, paths={"snapshot_dir": str(small_fs / "snapshots")}))
    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        before = complete(a)
        [snap] = snapshot_list(a)
        fill_until_full(small_fs / "filler")
        assert os.statvfs(small_fs).f_bavail == 0
        os.kill(a.status()["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(1)
        rec = st["last_recovery"]
        # CRIU's restore log and pidfile go to the run directory, not beside the images.
        assert rec["path"] == "full", rec
        assert [s["id"] for s in snapshot_list(a)] == [snap["id"]]
        assert complete(a) == before
        # A snapshot asked for while the disk is full fails, and the agent serves on.
        r = subprocess.run([sys.executable, "-m", "agent", "snapshot", "create", "--config",
                            str(a.config_path)], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
        assert r.returncode != 0, r.stdout
        assert a.proc.poll() is None, a.log_tail(3000)
        assert a.status()["state"] == "ready" and complete(a) == before
        assert [s["id"] for s in snapshot_list(a)] == [snap["id"]]
    finally:
        a.stop()
