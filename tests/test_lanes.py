"""The vLLM lane has exactly the modules that boot a vLLM engine: one left out would run its
engine beside another on the other worker."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.lanes import BOOTS_VLLM, VLLM, VLLM_MODULES, lane

TESTS = Path(__file__).resolve().parent


def _boots_vllm(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        names = {a.name for a in node.names}
        if names & BOOTS_VLLM.get(node.module, frozenset()):
            return True
        if node.module.removeprefix("tests.") in VLLM_MODULES:
            return True
    return False


def test_the_vllm_lane_is_every_module_that_boots_vllm_and_no_other() -> None:
    booting = {p.stem for p in TESTS.glob("test_*.py") if _boots_vllm(p.read_text())}
    assert booting - VLLM_MODULES == set(), (
        f"{sorted(booting - VLLM_MODULES)} boot vLLM: add them to tests/lanes.py VLLM_MODULES")
    assert VLLM_MODULES - booting == set(), (
        f"{sorted(VLLM_MODULES - booting)} are in the vLLM lane but boot no vLLM (or are gone)")


def test_a_module_importing_an_engine_helper_is_seen_and_a_constant_alone_is_not() -> None:
    assert _boots_vllm("from tests.vllmproc import CPU_ARGS, VLLM_PYTHON\n")
    assert _boots_vllm("from tests.test_agent_vllm import io_uring_off\n")
    assert not _boots_vllm("from tests.vllmproc import VLLM_PYTHON\n")
    assert not _boots_vllm("from tests.vllm_paths_kit import REVISION, vllm_config\n")


def test_a_node_of_a_vllm_module_is_in_the_vllm_lane_and_another_in_its_own() -> None:
    assert lane("tests/test_agent_vllm_models.py::test_x[qwen3-moe]") == VLLM
    assert lane("tests/test_lanes.py::test_y") == "test_lanes"
