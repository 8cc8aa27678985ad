"""A flag's value in engine.args is the one vLLM's parser would take."""

from __future__ import annotations

import pytest

from agent.engineargs import TENSOR_PARALLEL, flag_value, switch, workers
from agent.errors import ConfigError


@pytest.mark.parametrize(("args", "value"), [
    (["--max-model-len", "512"], None),
    (["--gpu-memory-utilization", "0.4"], "0.4"),
    (["--gpu-memory-utilization=0.4"], "0.4"),
    (["--gpu_memory_utilization", "0.4"], "0.4"),
    (["--gpu-memory-utilization", "0.9", "--gpu-memory-utilization=0.3"], "0.3"),
    (["--gpu-memory-utilization"], ""),
])
def test_a_flags_value_is_the_last_one_given_in_any_spelling(args: list[str],
                                                              value: str | None) -> None:
    assert flag_value(args, ["--gpu-memory-utilization"]) == value


def test_a_size_flag_left_out_is_one_worker_and_a_bad_one_names_the_flag() -> None:
    assert workers(["--max-model-len", "512"], TENSOR_PARALLEL) == 1
    assert workers(["-tp", "4"], TENSOR_PARALLEL) == 4
    for bad in (["-tp", "0"], ["-tp"], ["--tensor-parallel-size=x"]):
        with pytest.raises(ConfigError, match="--tensor-parallel-size .* is not a number"):
            workers(bad, TENSOR_PARALLEL)


@pytest.mark.parametrize(("args", "on"), [
    ([], False),
    (["--enforce-eager"], False),
    (["--kv-sharing-fast-prefill"], True),
    (["--kv_sharing_fast_prefill"], True),
    (["--kv-sharing-fast-prefill", "--no-kv-sharing-fast-prefill"], False),
    (["--no-kv-sharing-fast-prefill", "--kv-sharing-fast-prefill"], True),
])
def test_an_on_off_flag_is_the_last_one_given(args: list[str], on: bool) -> None:
    assert switch(args, "--kv-sharing-fast-prefill") is on
