"""The snapshot store on a real file system: publish, verify, select, quarantine, prune."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.errors import SnapshotError
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest, ProcessTree, Retention, SnapshotStore
from tests.prereq import require
from tests.snapshot_helpers import CANARY, IDENT, REPO, publish

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    s = SnapshotStore(tmp_path / "snaps")
    s.open(clean=True)
    return s


def test_published_snapshot_is_private_and_selected(store: SnapshotStore):
    m = publish(store)
    d = store.path(m.id)
    assert os.stat(store.root).st_mode & 0o777 == 0o700
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(d / "manifest.json").st_mode & 0o777 == 0o600
    assert os.stat(d / "pages-1.img").st_mode & 0o777 == 0o600
    sel = store.select(IDENT)
    assert sel.chosen == m and sel.skipped == ()
    assert store.load(m.id) == m
    assert m.image_bytes == 1004


def test_select_prefers_the_newest_and_names_the_older(store: SnapshotStore):
    old, new = publish(store, minutes=0), publish(store, minutes=5)
    sel = store.select(IDENT)
    assert sel.chosen is not None and sel.chosen.id == new.id
    assert [(s.id, s.refusal) for s in sel.skipped] == [
        (old.id, Refusal(RefusalCode.SUPERSEDED, f"older than the chosen {new.id}"))]


def test_select_of_a_kind_passes_over_the_other_kind(store: SnapshotStore):
    full = publish(store)
    sel = store.select(IDENT, kind="hybrid")
    assert sel.chosen is None
    assert [(s.id, s.refusal) for s in sel.skipped] == [
        (full.id, Refusal(RefusalCode.WRONG_KIND, "kind full, wanted hybrid"))]
    assert not sel.skipped[0].corrupt


def test_a_flipped_byte_is_refused_with_the_reason(store: SnapshotStore):
    good, bad = publish(store, minutes=0), publish(store, 1000, minutes=5, chunk=256)
    assert len(bad.files[1].sha256_chunks) == 4  # pages-1.img, 1000 bytes in 256-byte chunks
    path = store.path(bad.id) / "pages-1.img"
    data = bytearray(path.read_bytes())
    data[600] ^= 0x01
    path.write_bytes(bytes(data))
    v = store.verify(bad.id)
    assert not v.ok
    assert v.reasons == (f"{path}: sha256 differs from the manifest in 1 chunk(s), the first at "
                         "byte 512",)  # fmt: skip
    sel = store.select(IDENT)
    assert sel.chosen is not None and sel.chosen.id == good.id
    assert sel.skipped[0].id == bad.id and sel.skipped[0].refusal.code is RefusalCode.CORRUPT
    assert sel.skipped[0].corrupt and "sha256" in sel.skipped[0].refusal.detail


def test_unchanged_files_are_trusted_without_reading_them_again(store: SnapshotStore):
    m = publish(store, 5000)
    assert store.verify(m.id, full=False).hashed_bytes == 0
    assert store.verify(m.id).hashed_bytes == m.image_bytes  # `pitstop snapshot verify`
    assert store.select(IDENT).chosen == m


def test_a_byte_flipped_in_place_is_caught_even_when_unchanged_files_are_trusted(
        store: SnapshotStore):
    m = publish(store, 1000, chunk=256)
    path = store.path(m.id) / "pages-1.img"
    with open(path, "r+b") as f:  # same inode and size: only mtime and ctime move
        f.seek(600)
        byte = f.read(1)
        f.seek(600)
        f.write(bytes([byte[0] ^ 1]))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # mtime can be set back...
    v = store.verify(m.id, full=False)  # ...ctime cannot
    assert not v.ok and v.hashed_bytes == 1000
    assert "sha256 differs" in v.reasons[0]
    assert store.select(IDENT).chosen is None


def test_a_broken_sealed_record_means_hashing_everything(store: SnapshotStore):
    m = publish(store, 3000)
    (store.path(m.id) / "sealed.json").write_text("{not json")
    v = store.verify(m.id, full=False)
    assert v.ok and v.hashed_bytes == m.image_bytes


def test_snapshots_verify_always_hashes_at_every_select(tmp_path: Path):
    store = SnapshotStore(tmp_path / "snaps", trust_sealed=False)
    m = publish(store, 3000)
    calls = []
    real = store.verify
    store.verify = lambda sid, full=True, **kw: calls.append(full) or real(sid, full=full, **kw)  # type: ignore[method-assign]
    assert store.select(IDENT).chosen == m
    assert calls == [True]


def test_a_truncated_manifest_is_refused(store: SnapshotStore):
    m = publish(store)
    mf = store.path(m.id) / "manifest.json"
    os.truncate(mf, mf.stat().st_size // 2)
    sel = store.select(IDENT)
    assert sel.chosen is None
    assert sel.skipped[0].refusal.code is RefusalCode.UNREADABLE
    assert "manifest is invalid or truncated" in sel.skipped[0].refusal.detail
    assert [e.problem is not None for e in store.entries()] == [True]


def test_a_manifest_from_another_host_is_stale_and_names_each_field(store: SnapshotStore):
    foreign = IDENT.model_copy(update={"kernel": "5.15.0", "gpu_uuid": "GPU-other"})
    publish(store, ident=foreign)
    sel = store.select(IDENT)
    assert sel.chosen is None
    assert sel.skipped[0].refusal.code is RefusalCode.STALE
    reason = sel.skipped[0].refusal.detail
    assert f"kernel: '5.15.0' -> {IDENT.kernel!r}" in reason
    assert "gpu_uuid: 'GPU-other' -> None" in reason


def test_wrong_permissions_are_refused(store: SnapshotStore, tmp_path: Path):
    m = publish(store)
    os.chmod(store.path(m.id), 0o755)
    sel = store.select(IDENT)
    assert sel.chosen is None
    assert sel.skipped[0].refusal.code is RefusalCode.PERMISSIONS
    assert "mode 755 is looser than 700" in sel.skipped[0].refusal.detail
    os.chmod(store.path(m.id), 0o700)
    os.chmod(store.path(m.id) / "manifest.json", 0o644)
    [refused] = store.select(IDENT).skipped
    assert refused.refusal.code is RefusalCode.PERMISSIONS and "mode 644" in refused.refusal.detail
    os.chmod(store.path(m.id) / "manifest.json", 0o600)
    os.chmod(store.path(m.id) / "core-1.img", 0o644)
    # An image file that is not private fails verification: the snapshot is corrupt.
    [refused] = store.select(IDENT).skipped
    assert refused.refusal.code is RefusalCode.CORRUPT
    assert "core-1.img: not private" in refused.refusal.detail

    os.chmod(store.root, 0o770)
    with pytest.raises(SnapshotError, match="group- or world-writable"):
        store.select(IDENT)
    os.chmod(store.root, 0o700)
    link = tmp_path / "link"
    link.symlink_to(store.root)
    with pytest.raises(SnapshotError, match="is a symlink"):
        SnapshotStore(link).select(IDENT)


def test_a_foreign_owner_is_refused(store: SnapshotStore):
    require(os.geteuid() == 0, "chown to another uid needs root")
    m = publish(store)
    os.chown(store.path(m.id), 12345, 12345)
    [refused] = store.select(IDENT).skipped
    assert refused.refusal.code is RefusalCode.PERMISSIONS
    assert "owned by uid 12345" in refused.refusal.detail
    os.chown(store.root, 12345, 12345)
    with pytest.raises(SnapshotError, match="owned by uid 12345"):
        store.select(IDENT)


def test_unpublished_drafts_are_invisible_and_cleaned_at_start(store: SnapshotStore):
    with pytest.raises(RuntimeError), store.begin("full") as d:
        (d.dir / "pages-1.img").write_bytes(b"x")
        raise RuntimeError("dump failed")
    assert os.listdir(store.root) == []  # an exception removes the draft
    stale = store.root / ".tmp-20260101T000000Z-full-abcdef"
    stale.mkdir()
    (stale / "pages-1.img").write_bytes(b"x")
    assert store.entries() == [] and store.select(IDENT).chosen is None
    store.open(clean=True)
    assert not stale.exists()


# A writer that stops itself (SIGSTOP) before each step of its publish that the file system
# sees (an fsync, a rename, an unlink), after printing it: the test looks at the store at each
# stop, then lets it go on (SIGCONT) or kills it there.
_PAUSING_WRITER = """
import os, signal, sys
from datetime import timedelta
from pathlib import Path
from agent.store import Manifest, ProcessTree, SnapshotStore
from tests.snapshot_helpers import CANARY, IDENT, T0

def paused(name, real):
    def step(*args, **kwargs):
        print(name, *args, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args, **kwargs)
    return step

with SnapshotStore(Path(sys.argv[1])).begin("full", in_place=sys.argv[2] == "in_place") as d:
    (d.dir / "pages-1.img").write_bytes(b"x" * 100000)
    # Newer than the good one the test published: the one to choose once published.
    m = Manifest(id=d.id, kind="full", created_at=T0 + timedelta(minutes=1), identity=IDENT,
                 process=ProcessTree(root_pid=1, pids=(1,)), files=d.seal(), timings={},
                 canary=CANARY, chunk_bytes=d.chunk_bytes)
    for name in ("fsync", "rename", "replace", "unlink"):
        setattr(os, name, paused(name, getattr(os, name)))
    d.publish(m)
print("published", m.id, flush=True)
"""


class PausingWriter:
    """The writer above, publishing one snapshot into `store`."""

    def __init__(self, store: SnapshotStore, in_place: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PAUSING_WRITER, str(store.root),
             "in_place" if in_place else "renamed"], cwd=REPO, stdout=subprocess.PIPE,
            text=True)

    def next_step(self) -> str:
        """The step it stopped before ("rename <from> <to>"...), or "published <id>"."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("published"):
            # Stopped once its state says so: what the test sees next is from before the step.
            stat = Path(f"/proc/{self.proc.pid}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.005)
        return line

    def go_on(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _old_or_whole_new(store: SnapshotStore, good: Manifest) -> str:
    """What a reader sees now: the good snapshot or a whole newer one, nothing broken."""
    assert [e.problem for e in store.entries()] == [None] * len(store.ids())
    sel = store.select(IDENT)
    assert sel.chosen is not None, sel
    assert [s.refusal.code for s in sel.skipped] in ([], [RefusalCode.SUPERSEDED]), sel
    return sel.chosen.id


@pytest.mark.parametrize("in_place", [False, True], ids=["renamed", "in_place"])
def test_at_every_step_of_a_publish_a_reader_sees_the_old_snapshot_or_the_whole_new_one(
        store: SnapshotStore, in_place: bool):
    good = publish(store)
    writer = PausingWriter(store, in_place)
    seen, steps = set(), 0
    try:
        while not (step := writer.next_step()).startswith("published"):
            steps += 1
            seen.add(_old_or_whole_new(store, good))
            writer.go_on()
    finally:
        writer.kill()
    new = step.split()[1]
    assert steps >= 4 and good.id in seen and seen <= {good.id, new}, (steps, seen)
    assert _old_or_whole_new(store, good) == new


@pytest.mark.parametrize("in_place", [False, True], ids=["renamed", "in_place"])
def test_a_writer_killed_between_seal_and_publish_leaves_the_previous_good_one(
        store: SnapshotStore, in_place: bool):
    good = publish(store)
    writer = PausingWriter(store, in_place)
    # The step that publishes: the draft's rename to its id, or the removal of its mark.
    publishing = "unlink" if in_place else "rename"
    try:
        while not (step := writer.next_step()).startswith(publishing):
            assert not step.startswith("published"), step
            writer.go_on()
    finally:
        writer.kill()
    # Killed with its manifest written, the instant before it would have become visible.
    [draft] = [n for n in os.listdir(store.root) if n != good.id]
    assert (store.root / draft / "manifest.json").is_file()
    assert store.ids() == [good.id]
    assert _old_or_whole_new(store, good) == good.id
    store.open(clean=True)  # the next agent's start removes what the killed writer left
    assert os.listdir(store.root) == [good.id]


def test_publish_refuses_files_missing_from_the_manifest(store: SnapshotStore):
    with store.begin("full") as d:
        (d.dir / "a.img").write_bytes(b"a")
        files = d.seal()
        (d.dir / "late.img").write_bytes(b"late")
        m = Manifest(
            id=d.id, kind="full", created_at=T0, identity=IDENT,
            process=ProcessTree(root_pid=1, pids=(1,)), files=files, timings={}, canary=CANARY,
            chunk_bytes=d.chunk_bytes,
        )  # fmt: skip
        with pytest.raises(SnapshotError, match="late.img"):
            d.publish(m)
    assert os.listdir(store.root) == []


def test_quarantine_moves_it_aside_for_good(store: SnapshotStore):
    m = publish(store)
    q = store.quarantine(m.id, "canary answered 'x', expected '1'")
    assert store.entries() == [] and store.select(IDENT).chosen is None
    assert (q / "QUARANTINED").read_text() == "canary answered 'x', expected '1'\n"
    assert (q / "manifest.json").exists()


def test_delete_and_bad_ids(store: SnapshotStore):
    m = publish(store)
    store.delete(m.id)
    assert os.listdir(store.root) == []
    with pytest.raises(SnapshotError, match="no snapshot"):
        store.delete(m.id)
    with pytest.raises(SnapshotError, match="is not a snapshot id"):
        store.delete("../etc")


def test_prune_keeps_the_newest_n_within_the_budget(store: SnapshotStore):
    a, b, c = (publish(store, 1000, minutes=i) for i in range(3))
    assert store.prune(keep=2, budget_bytes=10_000) == [a.id]
    assert [e.id for e in store.entries()] == [c.id, b.id]
    # Over budget, the newest good one still stays.
    assert store.prune(keep=2, budget_bytes=10) == [b.id]
    assert [e.id for e in store.entries()] == [c.id]


def test_a_stray_file_in_the_store_is_listed_as_a_problem_and_never_stops_the_selection(
        store: SnapshotStore):
    m = publish(store)
    (store.root / "filler").write_bytes(b"\0" * 64)
    entries = {e.id: e for e in store.entries()}
    assert entries[m.id].problem is None
    assert entries["filler"].manifest is None
    problem = entries["filler"].problem
    assert problem is not None and problem.code is RefusalCode.NOT_A_SNAPSHOT
    assert "is not a snapshot directory" in problem.detail
    sel = store.select(IDENT)
    assert sel.chosen == m
    assert [(s.id, s.refusal) for s in sel.skipped] == [("filler", problem)]


def _quarantine_one(store: SnapshotStore, size: int, minutes: int, now: list[float]) -> str:
    m = publish(store, size, minutes=minutes)
    now[0] += 1
    store.quarantine(m.id, f"corrupt: test {minutes}", RefusalCode.CORRUPT)
    return m.id


def test_the_quarantine_keeps_its_newest_n(tmp_path: Path):
    now = [1_000_000.0]
    store = SnapshotStore(tmp_path / "snaps", clock=lambda: now[0],
                          retention=Retention(keep=None, quarantine_keep=2, budget_bytes=1 << 30))
    store.open()
    ids = [_quarantine_one(store, 1000, i, now) for i in range(4)]
    # Newest first; the two oldest went as the third and fourth arrived.
    assert [q.id for q in store.quarantined()] == [ids[3], ids[2]]
    assert [q.reason for q in store.quarantined()] == ["corrupt: test 3", "corrupt: test 2"]
    assert sorted(os.listdir(store.root / ".quarantine")) == sorted(
        q.path.name for q in store.quarantined())
    assert not [n for n in os.listdir(store.root) if n.startswith(".tmp-")]


def test_the_quarantine_fits_in_the_disk_budget_beside_the_published_ones(tmp_path: Path):
    now = [1_000_000.0]
    store = SnapshotStore(tmp_path / "snaps", clock=lambda: now[0],
                          retention=Retention(keep=None, quarantine_keep=5, budget_bytes=25_000))
    store.open()
    a = _quarantine_one(store, 10_000, 0, now)
    b = _quarantine_one(store, 10_000, 1, now)
    assert [q.id for q in store.quarantined()] == [b, a]
    # A good snapshot takes its room first: the oldest quarantined one goes at the next prune.
    publish(store, 10_000, minutes=5)
    store.prune(keep=2, budget_bytes=25_000)
    assert [q.id for q in store.quarantined()] == [b]
    # One bigger than the room left is not kept at all.
    _quarantine_one(store, 30_000, 6, now)
    assert [q.id for q in store.quarantined()] == [b]


def test_without_a_retention_the_quarantine_is_only_pruned_when_asked(store: SnapshotStore):
    ids = [publish(store, minutes=i).id for i in range(3)]
    for sid in ids:
        store.quarantine(sid, "corrupt: x")
    assert len(store.quarantined()) == 3
    assert len(store.prune_quarantine(keep=1, budget_bytes=1 << 30)) == 2
    assert [q.code for q in store.quarantined()] == [None]


def test_a_draft_made_in_place_is_invisible_until_published_and_cleaned_at_start(
        store: SnapshotStore):
    with store.begin("vllm", in_place=True) as d:
        assert d.dir == store.root / d.id
        (d.dir / "vllm").mkdir()
        (d.dir / "vllm" / "pages-1.img").write_bytes(b"x" * 100)
        assert store.ids() == [] and store.entries() == []
        files = d.seal()
        assert [f.name for f in files] == ["vllm/pages-1.img"]
        d.publish(Manifest(id=d.id, kind="vllm", created_at=T0, identity=IDENT,
                           process=ProcessTree(root_pid=1, pids=(1,)), files=files,
                           timings={}, canary=CANARY, chunk_bytes=d.chunk_bytes))
    assert store.ids() == [d.id] and store.verify(d.id).ok
    # One left by a writer that died: never listed, removed by the owner at its start.
    with pytest.raises(RuntimeError), store.begin("vllm", in_place=True) as d2:
        left = d2.dir
        raise RuntimeError("vllm snapshot create failed")
    assert not left.exists()
    stale = store.root / "20260101T000000Z-vllm-abcdef"
    stale.mkdir()
    (stale / ".draft").write_bytes(b"")
    assert store.ids() == [d.id]
    store.open(clean=True)
    assert not stale.exists() and store.ids() == [d.id]
