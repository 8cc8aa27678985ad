"""A copy on disk of a set an engine holds in its own layout (vLLM's parameters), and the
refill that loads it back into a holder that lost it; a real cpu holder."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
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
