"""A copy on disk of a set an engine holds in its own layout (vLLM's parameters), and the
refill that loads it back into a holder that lost it; a real cpu holder."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import HolderError, HolderRefusedError
from agent.holder import protocol as p
from agent.holder.heldcopy import COPY_DIR, copy_held
from agent.holder.weightplan import PlanSource, RefillPlan, load_plan, write_plan
from tests.holder_proc import Holder, wait_for
from tests.test_holder_refill import region_bytes

pytestmark = pytest.mark.integration

DIGEST = "sha256:" + "5e" * 32
# As vLLM's plugin names its one region: the digest, then the layout's signature.
REGION = f"{DIGEST}/vllm-params-0123456789abcdef"
# Not a multiple of the page: the memfd is padded, the copy is not.
DATA = os.urandom(3 * 4096 + 123)


def _engine_commits(holder: Holder, data: bytes = DATA) -> None:
    """What vLLM's first start does through the plugin: create, fill, commit."""
    with holder.client() as c:
        with c.create(REGION, len(data), DIGEST, parts=1) as g:
            os.pwrite(g.fds[0], data, 0)
        c.commit(REGION)


@pytest.fixture
def held(tmp_path: Path) -> tuple[Holder, RefillPlan]:
    h = Holder(tmp_path / "holder")
    _engine_commits(h)
    plan = copy_held(h.sock, DIGEST, h.sock.parent / COPY_DIR)
    write_plan(h.sock.parent, plan)
    return h, plan


def test_the_copy_has_the_held_bytes_and_its_plan_names_them(held):
    h, plan = held
    try:
        [f] = plan.files
        [r] = plan.regions
        assert plan.source is PlanSource.COPY and plan.digest == DIGEST
        assert (r.name, r.offset, r.size) == (REGION, 0, len(DATA))
        assert (Path(plan.model) / f.name).read_bytes() == DATA
        assert oct((Path(plan.model) / f.name).stat().st_mode & 0o777) == "0o600"
        assert plan.drift() is None and load_plan(h.sock.parent) == plan
    finally:
        h.stop()


@contextlib.contextmanager
def _restarted(h: Holder, *args: str) -> Iterator[Holder]:
    """The holder stopped (its memory gone with it) and a new one on its directory."""
    h.stop()
    again = Holder(h.base, *args)
    try:
        yield again
    finally:
        again.stop()


def test_a_holder_restarted_empty_refills_the_copy_to_the_same_bytes(held):
    h, _ = held
    with _restarted(h, "--no-refill") as empty:
        assert empty.stats().bytes_held == 0
        assert empty.client().refill(DIGEST).bytes == len(DATA)
        assert region_bytes(empty, REGION) == DATA


def test_a_holder_started_beside_a_copy_plan_refills_by_itself(held):
    h, _ = held
    with _restarted(h) as again, again.client() as c:
        wait_for(lambda: c.has_committed(DIGEST), "the start-up refill", timeout=30)
        assert region_bytes(again, REGION) == DATA


def test_a_copy_changed_on_disk_is_drift_and_nothing_is_refilled(held):
    h, plan = held
    copy = Path(plan.model) / plan.files[0].name
    with _restarted(h, "--no-refill") as empty:
        copy.write_bytes(b"\0" * len(DATA))
        with pytest.raises(HolderRefusedError) as refused:
            empty.client().refill(DIGEST)
        assert refused.value.code == p.ErrorCode.DRIFT
        assert copy.name in str(refused.value)
        assert empty.stats().regions_committed == 0


def test_a_set_not_committed_yet_is_not_copied(tmp_path):
    h = Holder(tmp_path / "holder")
    try:
        with (h.client() as c, c.create(REGION, len(DATA), DIGEST, parts=1),
              pytest.raises(HolderError, match="no committed set")):
            copy_held(h.sock, DIGEST, tmp_path / "copies")
        assert not (tmp_path / "copies").exists() or not any((tmp_path / "copies").iterdir())
    finally:
        h.stop()


def test_the_copier_runs_as_its_own_process_and_prints_the_plan(tmp_path):
    h = Holder(tmp_path / "holder")
    try:
        _engine_commits(h)
        out = tmp_path / "copies"
        r = subprocess.run([sys.executable, "-m", "agent.holder.heldcopy", "--socket",
                            str(h.sock), "--digest", DIGEST, "--out", str(out)],
                           capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).resolve().parent.parent)
        assert r.returncode == 0, r.stderr
        plan = RefillPlan.model_validate_json(r.stdout)
        assert (out / plan.files[0].name).read_bytes() == DATA
        # Without a committed set: a one-line reason, status 1.
        bad = subprocess.run([sys.executable, "-m", "agent.holder.heldcopy", "--socket",
                              str(h.sock), "--digest", "sha256:" + "00" * 32, "--out",
                              str(out)], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parent.parent)
        assert bad.returncode == 1 and bad.stderr.startswith("heldcopy: ")
    finally:
        h.stop()


def test_a_cuda_holders_set_is_copied_through_device_memory_piece_by_piece(tmp_path):
    """The cuda backend's regions are read back as an engine maps them: the grant's fds
    imported into a reserved VA range, then copied device to host piece by piece through one
    pinned buffer (on the driver fake, whose device memory is the holder's own chunks). The
    copy and its plan are the ones a memfd read gives, and all the read made is given back."""
    from agent.holder.heldcopy import PIECE, CudaReader
    from tests.fake_cuda import FakeCuda

    data = os.urandom(2 * PIECE + 12345)  # three pieces, the last one short
    h = Holder(tmp_path / "holder")
    try:
        _engine_commits(h, data)
        cu = FakeCuda()
        plan = copy_held(h.sock, DIGEST, tmp_path / "cuda", device_reader=CudaReader(cu))
        same = (tmp_path / "cuda" / plan.files[0].name).read_bytes() == data  # no 32 MB diff
        assert same, "the copy is not the held bytes"
        assert cu.copied_dtoh == len(data)
        assert +cu.live == Counter(), cu.live  # imports, VA, context, pinned buffer
        memfd = copy_held(h.sock, DIGEST, tmp_path / "memfd")
        assert [(f.name, f.size, f.sha256) for f in plan.files] == \
            [(f.name, f.size, f.sha256) for f in memfd.files]
        assert plan.regions == memfd.regions
    finally:
        h.stop()


def test_a_cuda_region_of_several_chunks_reads_back_in_order_across_their_edges():
    """A cuda region over 1 GiB is several exported allocations: the pieces cross their
    edges, and the padding of the last chunk is not part of the copy."""
    from agent.holder.heldcopy import PIECE, CudaReader
    from tests.fake_cuda import FakeCuda

    chunk = PIECE + (1 << 20)  # pieces straddle every chunk's end
    data = os.urandom(3 * chunk - 4096 - 7)
    fds = []
    try:
        for i in range(3):
            fd = os.memfd_create(f"chunk{i}")
            os.ftruncate(fd, chunk)
            os.pwrite(fd, data[i * chunk:(i + 1) * chunk], 0)
            fds.append(fd)
        region = p.RegionInfo(name=REGION, size=len(data), digest=DIGEST, parts=1, epoch=1,
                              holder_id="h", committed=True, chunks=[chunk] * 3, align=4096)
        cu = FakeCuda()
        reader = CudaReader(cu)
        same = b"".join(bytes(piece) for piece in reader.pieces(region, fds)) == data
        assert same, "the pieces are not the region's bytes in order"
        assert +cu.live == Counter(), cu.live
    finally:
        for fd in fds:
            os.close(fd)
