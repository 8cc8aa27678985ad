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
