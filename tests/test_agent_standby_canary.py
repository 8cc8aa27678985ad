"""A standby whose answer is wrong never serves: its canary fails and the hybrid rung restores."""

from __future__ import annotations

import os
import subprocess

import pytest

from agent.holder.protocol import MemoryKind
from tests.agentproc import RunningAgent, agent_config, complete, fallthroughs, snapshot_list
from tests.holder_proc import Holder, wait_for
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required
from tests.test_agent_standby import _armed, kill_and_expect_hybrid

pytestmark = pytest.mark.integration


def twin_with_other_bytes(real: Holder, twin: Holder) -> int:
    """Every committed region of `real` again in `twin`: the same names, digests, sizes and
    chunks (what a re-attach of weights checks), every byte flipped. Returns how many."""
    n = 0
    with real.client() as src, twin.client() as dst:
        for r in src.list():
            if not r.committed:
                continue
            with src.attach(r.name) as g:
                data = b"".join(os.pread(fd, size, 0) for fd, size in zip(g.fds, r.chunks,
                                                                          strict=True))
            with dst.create(r.name, r.size, r.digest, parts=r.parts,
                            memory=MemoryKind(r.memory)) as g:
                assert list(g.region.chunks) == list(r.chunks), (g.region, r)
                at = 0
                for fd, size in zip(g.fds, r.chunks, strict=True):
                    os.pwrite(fd, bytes(b ^ 0x5A for b in data[at:at + size]), 0)
                    at += size
            dst.commit(r.name)
            n += 1
    return n


@pytest.fixture(scope="module")
def standby(tmp_path_factory, tiny_model):
    """A cpu-backend holder, an agent with snapshots.standby on (no KV pool kept in the
    holder: only the weights are re-attached by digest), a standby armed."""
    tmp = tmp_path_factory.mktemp("standby-canary")
    holder = Holder(tmp / "holder")
    a = RunningAgent(tmp, agent_config(
        tmp, tiny_model, engine={"args": ["--no-keep-kv"]},
        holder={"enabled": True, "dir": str(tmp / "holder"), "gpu": "cpu"},
        snapshots={"standby": True}))
    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        yield a, holder, tmp
    finally:
        a.stop()
        holder.stop()


def test_a_standby_that_answers_wrong_fails_its_canary_and_the_hybrid_rung_serves(standby):
    a, holder, tmp = standby
    before = complete(a)
    _, ns_init = _armed(a)
    armed = a.wait_for(lambda s: (s.get("standby") or {}).get("armed"), 30,
                       "the standby armed")["standby"]["snapshot"]
    # Inside the standby's mount namespace only, the holder's socket is a twin's that holds
    # the same regions with other bytes: the copy re-attaches them (same digest, size and
    # chunks) and answers something else. The live engine and the hybrid rung see the real
    # holder.
    twin = Holder(tmp / "twin")
    try:
        assert twin_with_other_bytes(holder, twin) >= 1
        subprocess.run(["nsenter", "-t", str(ns_init), "-m", "mount", "--bind", str(twin.sock),
                        str(holder.sock)], check=True)
        rec = kill_and_expect_hybrid(a, ("verify_failed", "verify_failed"))
    finally:
        twin.stop()
    assert "canary answered" in fallthroughs(rec)[0], fallthroughs(rec)
    assert complete(a) == before
    # The snapshot is not set aside for the standby's failure: the hybrid rung restored it.
    assert armed in {x["id"] for x in snapshot_list(a)}
    wait_for(lambda: (a.status().get("standby") or {}).get("armed"), "the next standby armed",
             timeout=120)
