"""Identities: collected from this host, compared field by field."""

from __future__ import annotations

import os

from agent.drift import compare, describe
from agent.identity import SELECTED_ENV, Identity, collect


def test_collect_reads_this_host():
    ident = collect(
        engine_kind="reference", engine_version="0.1.0", criu="4.1.1",
        engine_args=("--device", "cpu"), environ={"OMP_NUM_THREADS": "2", "HOME": "/root"},
    )  # fmt: skip
    assert ident.kernel == os.uname().release
    assert ident.env == {"OMP_NUM_THREADS": "2"}  # only selected variables
    assert ident.engine_args == ("--device", "cpu")
    assert "OMP_NUM_THREADS" in SELECTED_ENV
    assert Identity.model_validate_json(ident.model_dump_json()) == ident


def test_compare_names_every_differing_field_old_to_new():
    a = collect(engine_kind="reference", engine_version="1", criu="4.1.1")
    assert compare(a, a) == []
    b = a.model_copy(update={"criu": "4.2", "engine_version": "2", "env": {"X": "1"}})
    diffs = compare(a, b)
    assert [d.field for d in diffs] == ["engine_version", "criu", "env"]
    assert describe(diffs) == (
        "engine_version: '1' -> '2'; criu: '4.1.1' -> '4.2'; env: {} -> {'X': '1'}"
    )


def test_the_gpu_uuid_is_remapped_and_everything_else_must_match():
    from agent.drift import classify
    from agent.identity import REMAPPED_FIELDS

    IDENT_GPU = collect(engine_kind="vllm", engine_version="0.32.0", criu="4.2.1").model_copy(
        update={"gpu_name": "NVIDIA H200", "gpu_memory_bytes": 150 << 30})
    a = "GPU-" + "a" * 32
    old = IDENT_GPU.model_copy(update={"gpu_uuid": a, "env": {"CUDA_VISIBLE_DEVICES": a}})
    new = old.model_copy(update={"gpu_uuid": "GPU-" + "b" * 32,
                                 "env": {"CUDA_VISIBLE_DEVICES": "GPU-" + "b" * 32}})
    # Where the engine's environment names the GPU by its UUID, that is the GPU remapped too.
    [d] = classify(old, new)
    assert (d.field, d.remapped) == ("gpu_uuid", True)
    assert str(d) == f"gpu_uuid: '{a}' -> 'GPU-{'b' * 32}'"
    assert compare(old, new, REMAPPED_FIELDS) == []
    # Strict by default (the drift watcher: the engine's own GPU changed under it).
    assert [x.field for x in compare(old, new)] == ["gpu_uuid", "env"]
    other = new.model_copy(update={"kernel": "6.1.0", "gpu_memory_bytes": 80 << 30})
    assert [(x.field, x.remapped) for x in classify(old, other)] == [
        ("gpu_uuid", True), ("gpu_memory_bytes", False), ("kernel", False)]


def test_a_stale_reason_names_only_the_arguments_that_differ():
    a = collect(engine_kind="reference", engine_version="1", criu="4.1.1",
                engine_args=("/usr/bin/python3", "-m", "srv", "--kv-slots", "8", "--x"))
    b = a.model_copy(update={"engine_args": ("/opt/venv/bin/python3", "-m", "srv",
                                             "--kv-slots", "8", "--y", "--z")})
    c = a.model_copy(update={"engine_args": a.engine_args[:-1]})
    assert describe(compare(a, b), brief=True) == (
        "engine_args: [0] '/usr/bin/python3' -> '/opt/venv/bin/python3', "
        "[5] '--x' -> '--y' '--z'")
    assert describe(compare(a, c), brief=True) == "engine_args: [5] '--x' removed"
    assert describe(compare(c, a), brief=True) == "engine_args: [5] '--x' added"
    # Other fields read as in full.
    assert describe(compare(a, a.model_copy(update={"criu": "4.2"})), brief=True) == \
        "criu: '4.1.1' -> '4.2'"
