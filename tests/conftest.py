"""Shared fixtures: the tiny model (cached under .cache/models) and a reference engine."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import agentproc
from tests.holder_proc import Holder
from tests.refengine_proc import REPO, Engine, run_engine

MODEL_CACHE = REPO / ".cache" / "models"


def cached_model(size: str = "tiny", seed: int = 0, arch: str = "llama",
                 quant: str = "none") -> Path:
    """A generated model under .cache/models, keyed by everything that determines it;
    made from scratch when absent (make_model is idempotent and atomic)."""
    from agent.modelgen import make_model, record_for, spec_for

    spec = spec_for(size, seed=seed, arch=arch, quant=quant)
    key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode()).hexdigest()[:16]
    kind = "".join(f"-{v}" for v in (arch, quant) if v not in ("llama", "none"))
    directory = MODEL_CACHE / f"{size}{kind}-{key}"
    make_model(directory, spec)
    return directory


@pytest.fixture(autouse=True)
def _no_agent_outlives_its_test() -> Iterator[None]:
    # Wider-scoped fixtures are set up first: agents running now belong to them.
    before = agentproc.running()
    yield
    agentproc.stop_all(keep=before)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return cached_model("tiny")


@pytest.fixture(scope="session")
def refengine(tiny_model: Path) -> Iterator[Engine]:
    """One engine for the session; 4 KV slots so that 8 concurrent requests must queue."""
    with run_engine(tiny_model, "--kv-slots", "4", "--max-model-len", "512") as engine:
        yield engine


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    """A `pitstop holder --backend cpu` on a private directory; must stop cleanly (exit 0)."""
    h = Holder(tmp_path / "holder")
    try:
        yield h
    finally:
        rc = h.stop()
        assert rc == 0, h.log.read_text()


# Hypothesis keeps its example database under .cache (ignored), never in the repository.
def _hypothesis_profile() -> None:
    from hypothesis import settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    settings.register_profile(
        "pitstop", database=DirectoryBasedExampleDatabase(str(REPO / ".cache" / "hypothesis")))
    settings.load_profile("pitstop")


_hypothesis_profile()
