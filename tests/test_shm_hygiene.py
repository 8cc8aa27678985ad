"""The suite's own clean-up of /dev/shm: what a run made and nobody uses goes, nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import shm_hygiene

HOLD = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 4096)
held = os.open(sys.argv[2], os.O_RDWR)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_only_the_runs_own_unused_ring_buffers_are_removed(tmp_path: Path):
    (tmp_path / "psm_before").write_bytes(b"x" * 4096)
    before = shm_hygiene.names(tmp_path)
    tp_segment = "vllm_dist_735206eb-tp:0-[0-1]-cpushm_0"
    for name in ("psm_mapped", "psm_open", "psm_dead", tp_segment, "not_vllms"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "psm_mapped"),
                          str(tmp_path / "psm_open")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert shm_hygiene.remove_leftovers(before, tmp_path) == ["psm_dead", tp_segment]
    finally:
        p.kill()
        p.wait()
    assert sorted(n.name for n in tmp_path.iterdir()) == [
        "not_vllms", "psm_before", "psm_mapped", "psm_open"]
