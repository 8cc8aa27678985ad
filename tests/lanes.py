"""How `make test` splits the suite over pytest-xdist workers, and what keeps the split safe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.prereq import in_ci

# The lane of every module that boots a vLLM engine: its tests run on one worker, one after
# the other (`scheduler`, whatever --dist says), so two vLLM engines never run at once (each
# takes GiBs, and both cores to boot).
VLLM = "vllm"
VLLM_MODULES = frozenset(
    {
        "test_agent_remote_vllm",
        "test_agent_snapshot_after_traffic",
        "test_agent_vllm",
        "test_agent_vllm_hybrid",
        "test_agent_vllm_models",
        "test_agent_vllm_refusal",
        "test_agent_vllm_tp",
        "test_install",  # a fresh venv's agent serving vLLM
        "test_loop_free",  # a vLLM engine behind a slow interpreter wrapper
        "test_vllm_engine",
        "test_vllm_parity",
        "test_vllm_paths_cli",
        "test_vllm_paths_rungs",
    }
)
# What a module takes from the vLLM helpers to boot an engine (its CPU flags, the server, the
# adapter, the interpreter for vLLM's CLI), or, from any module above, anything: a module that
# takes one belongs in VLLM_MODULES (tests/test_lanes.py holds the two together).
BOOTS_VLLM = {"tests.vllmproc": frozenset({"CPU_ARGS", "VllmServer", "vllm_adapter"}),
              "tests.vllm_paths_kit": frozenset({"vllm_python"})}
# Every other module is a lane of its own: its module-scoped fixtures (an agent, a container
# fleet) are set up once, on one worker. Handed out first, the longest lanes: neither the
# vLLM one nor the Ansible fleet's is left to run alone at the end.
FIRST = (VLLM, "test_ansible_hosts")


def lane(nodeid: str) -> str:
    """The lane of a test, by its node ID (tests/test_x.py::test_y[z])."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return VLLM if module in VLLM_MODULES else module


def first_lanes_first(items: list[pytest.Item]) -> None:
    """The FIRST lanes first, each test's order in its lane kept: with
    `--no-loadscope-reorder` the workers are handed lanes in collection order."""

    def rank(item: pytest.Item) -> int:
        name = lane(item.nodeid)
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable


def scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's loadscope scheduling with the lanes as its scopes: a worker is handed a
    whole lane at a time, and runs its tests in order."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return LaneScheduling(config, log)


# CRIU restores every process and thread with the ID it was dumped with, and one still taken
# fails the restore (agent/proc.py, ids_in_use). With one test at a time no other process can
# be handed a dumped ID between its dump and its restore; with two workers the other one's
# processes could, once the kernel's IDs wrap around, which at the usual pid_max of 32768
# happens several times in a run. So while the workers run the kernel hands out IDs from the
# widest space it has, from low numbers up: none is handed out twice in a run.
PID_MAX = Path("/proc/sys/kernel/pid_max")
LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
PID_MAX_LIMIT = 4194304  # the kernel's largest pid_max on 64-bit
RESERVED_PIDS = 300  # below this the kernel hands out no ID after a wrap
HEADROOM = 1 << 21  # IDs left before a wrap: a run takes far fewer


def widen_pid_space() -> int | None:
    """Raise pid_max to the limit and, when fewer than HEADROOM IDs are left above the last
    one handed out, go on from the bottom; returns the pid_max to put back (None: unchanged).
    Under CI=true a pid space that cannot be widened stops the run."""
    if not (os.access(PID_MAX, os.W_OK) and os.access(LAST_PID, os.W_OK)):
        why = (
            f"{PID_MAX} is not writable: two workers could restore a CRIU image into an ID "
            "the other took; run the tests as root, or without -n"
        )
        if in_ci():
            raise pytest.UsageError(f"prerequisite missing under CI=true: {why}")
        return None
    before = int(PID_MAX.read_text())
    if before < PID_MAX_LIMIT:
        PID_MAX.write_text(str(PID_MAX_LIMIT))
    if PID_MAX_LIMIT - int(LAST_PID.read_text()) < HEADROOM:
        LAST_PID.write_text(str(RESERVED_PIDS))
    return before if before < PID_MAX_LIMIT else None


def restore_pid_space(before: int | None) -> None:
    if before is not None:
        PID_MAX.write_text(str(before))
