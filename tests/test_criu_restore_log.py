"""bench/criu_restore_log.py: a real CRIU restore's debug log, summed up per process: the
pages it restored and the reads that put them in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.snapshot_helpers import (
    CANARY,
    Counter,
    capture,
    identity,
    inc,
    kill_and_reap,
    snapshotter,
    subreaper,  # noqa: F401 - autouse: this process reaps restored trees
)

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parent.parent / "bench"
BALLAST_MIB = 24


def test_a_debug_log_says_how_long_the_ballast_took_to_read_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import criu_restore_log

    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    c = Counter(tmp_path / "c.sock", BALLAST_MIB)
    assert c.inc() == 1
    info = capture(snap, c.pid, canary=CANARY, identity=identity(snap.criu.version))
    c.stop()
    logs = {}
    for level in (2, 4):
        snap.criu.restore_verbosity = level
        r = snap.restore(info.manifest)
        try:
            assert inc(c.sock) == 2
        finally:
            kill_and_reap(r.pid)
            for f in set(r.outputs.values()):
                f.close()
        logs[level] = r.log_path

    log = criu_restore_log.read_log(logs[4])
    (root,) = [p for p in log.processes if p.pid == c.pid]
    # The ballast (os.urandom: pages of random bytes) is read back whole, in one call or a few.
    assert root.pages * 4096 >= BALLAST_MIB << 20
    assert root.bytes >= BALLAST_MIB << 20 and root.calls >= 1 and root.iovs >= 1
    assert 0 < root.read_s <= log.read_s_max
    # A Python process maps its interpreter, libraries, heap and stacks: dozens of mappings.
    assert root.vmas >= 20 and root.threads >= 1
    assert log.finished_s is not None and root.read_s < log.finished_s <= log.last_s

    assert criu_restore_log.main([str(logs[4]), "--json"]) == 0
    assert str(c.pid) in capsys.readouterr().out
    # A log without timestamps (Pitstop's default level) is refused by name.
    assert criu_restore_log.main([str(logs[2])]) == 1
    assert "not CRIU's debug log (-v4" in capsys.readouterr().err
