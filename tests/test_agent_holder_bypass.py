"""A start over the holder that fails is followed by one without it, through the real agent
(a real `pitstop holder --backend cpu` that cannot allocate the weights, the reference
engine on CPU): the engine serves instead of failing the same way at every start."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from agent import proc
from agent.config import Config, parse_config
from agent.engines import build_adapter
from agent.refusal import RefusalCode
from agent.supervisor.ladder import Prepared
from agent.supervisor.paths.holder import ColdOverHolder, HolderLink
from tests.agentproc import RunningAgent, agent_config, complete
from tests.holder_proc import Holder, wait_for


def engine_argv(pid: int) -> list[str]:
    """The command line of the engine the agent names, or of its one child when that is a
    small root of Pitstop's."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    children = list(proc.children_of(pid))
    if "--holder" not in argv and children:
        argv += Path(f"/proc/{children[0]}/cmdline").read_bytes().decode().split("\0")
    return argv


def bypassed(a: RunningAgent) -> float | None:
    """pitstop_holder_bypassed now; None before the agent has read the holder."""
    try:
        return a.metric("pitstop_holder_bypassed")
    except AssertionError:
        return None


def codes(rec: dict) -> dict[str, str]:
    return {f["path"]: f["refusal"]["code"] for f in rec["fallthroughs"]}


def held_config(tmp_path: Path, tiny_model: Path) -> Config:
    return parse_config(agent_config(tmp_path, tiny_model, holder={
        "enabled": True, "dir": str(tmp_path / "holder"), "gpu": "cpu"}), "test")


def link_and_cold(tmp_path: Path, tiny_model: Path, digest: list[str]
                  ) -> tuple[HolderLink, ColdOverHolder]:
    cfg = held_config(tmp_path, tiny_model)
    adapter = build_adapter(cfg)
    link = HolderLink(cfg.holder, cfg.paths.run, gpu=lambda: "cpu", digest=lambda: digest[0],
                      adapter=adapter)
    return link, ColdOverHolder(adapter, link)


def test_the_bypass_lasts_until_the_weights_change_or_a_reload(tmp_path, tiny_model) -> None:
    digest = ["sha256:a"]
    link, cold = link_and_cold(tmp_path, tiny_model, digest)
    asyncio.run(cold.failed(Prepared("cold", ("--holder", "x")), "exited with status 1"))
    refusal = link.unavailable()
    assert refusal is not None and refusal.code is RefusalCode.HELD_START_FAILED
    assert "exited with status 1" in refusal.detail and "reload" in refusal.detail
    assert link.bypassed() and link.engine_args() == []

    digest[0] = "sha256:b"  # another model: its start over the holder may well fit
    assert not link.bypassed()
    assert link.unavailable().code is not RefusalCode.HELD_START_FAILED

    digest[0] = "sha256:a"
    assert link.bypassed()
    link.reconfigure(held_config(tmp_path, tiny_model))
    assert not link.bypassed()


def test_a_failed_start_without_the_holders_flags_does_not_bypass_it(tmp_path, tiny_model):
    link, cold = link_and_cold(tmp_path, tiny_model, ["sha256:a"])
    asyncio.run(cold.failed(Prepared("cold", ()), "exited with status 1"))
    assert not link.bypassed()


@pytest.mark.integration
def test_a_start_over_a_holder_that_cannot_hold_the_weights_is_retried_without_it_until_a_reload(
    tmp_path: Path, tiny_model: Path
) -> None:
    # The tiny model's weights are 2.5 MB: a holder capped at 1 MiB refuses them, as a GPU
    # holder's allocation fails when the GPU has no room.
    holder = Holder(tmp_path / "holder", "--max-bytes", str(1 << 20))
    cfg = agent_config(tmp_path, tiny_model, snapshots={"enabled": False},
                       holder={"enabled": True, "dir": str(tmp_path / "holder"), "gpu": "cpu"})
    a = RunningAgent(tmp_path, cfg)
    try:
        st = a.wait_ready()
        assert "a start over the holder failed" in a.log()
        rec = st["last_recovery"]
        assert (rec["path"], rec["result"]) == ("cold", "success")
        assert codes(rec)["warm"] == "held_start_failed"
        assert "--holder" not in engine_argv(st["engine_pid"])
        assert complete(a)
        assert holder.stats().regions_committed == 0
        wait_for(lambda: bypassed(a) == 1, "the bypass metric", 30)
        assert "bypassed: the last start over it failed" in a.pitstop("status").stdout

        # A crash does not try the holder again: the same weights would fail the same way.
        os.kill(st["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(1)
        assert codes(st["last_recovery"])["warm"] == "held_start_failed"
        assert st["last_recovery"]["path"] == "cold"
        assert "--holder" not in engine_argv(st["engine_pid"])

        # Room again, and a reload: the next start holds the weights.
        holder.stop()
        holder = Holder(tmp_path / "holder")
        a.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: bypassed(a) == 0, "the bypass to end", 30)
        os.kill(st["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(2)
        assert st["last_recovery"]["path"] == "cold"
        assert "held_start_failed" not in codes(st["last_recovery"]).values()
        assert "--holder" in engine_argv(st["engine_pid"])
        assert holder.stats().regions_committed > 0
        assert complete(a)
    finally:
        a.stop()
        holder.stop()
