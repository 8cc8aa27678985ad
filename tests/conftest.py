"""Shared fixtures: the tiny model (cached under .cache/models) and a reference engine."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import agentproc, lanes, shm_hygiene
from tests.holder_proc import Holder
from tests.refengine_proc import REPO, Engine, run_engine

MODEL_CACHE = REPO / ".cache" / "models"


def cached_model(size: str = "tiny", seed: int = 0, arch: str = "llama",
                 quant: str = "none") -> Path:
    """A generated model under .cache/models, keyed by everything that determines it;
    made from scratch when absent (make_model is idempotent and atomic), under a lock: two
    workers making the same one at once would each rename theirs into place."""
    from agent.modelgen import make_model, record_for, spec_for

    spec = spec_for(size, seed=seed, arch=arch, quant=quant)
    key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode()).hexdigest()[:16]
    kind = "".join(f"-{v}" for v in (arch, quant) if v not in ("llama", "none"))
    directory = MODEL_CACHE / f"{size}{kind}-{key}"
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with open(MODEL_CACHE / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        make_model(directory, spec)
    return directory


@contextlib.contextmanager
def module_scratch(request: pytest.FixtureRequest, name: str) -> Iterator[Path]:
    """`tmp_path_factory.mktemp(name)` for a module's fixture, removed when the fixture is done
    unless a test of this worker failed (then it stays, for its logs). A vLLM module's images
    and model copies are gigabytes; kept to the end of the run, with the per-test dirs,
    they filled the disk of a CI machine. Per-test dirs go by pyproject's
    `tmp_path_retention_policy`."""
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    path = factory.mktemp(name)
    failed_before = request.session.testsfailed
    yield path  # a fixture that raised while it ended leaves its files too
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


# --- parallel runs (`make test`: pytest-xdist, each lane on one worker; tests/lanes.py) ---
_PID_MAX_BEFORE = pytest.StashKey[int | None]()
_SHM_BEFORE = pytest.StashKey[set[str]]()


def _parallel_controller(config: pytest.Config) -> bool:
    workers = getattr(config.option, "numprocesses", None)  # -n; None without pytest-xdist
    return bool(workers) and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _parallel_controller(config):
        config.stash[_PID_MAX_BEFORE] = lanes.widen_pid_space()
    if not hasattr(config, "workerinput"):  # the run's one controller, or a run without -n
        config.stash[_SHM_BEFORE] = shm_hygiene.names()


def pytest_unconfigure(config: pytest.Config) -> None:
    lanes.restore_pid_space(config.stash.get(_PID_MAX_BEFORE, None))
    before = config.stash.get(_SHM_BEFORE, None)
    if before is not None:  # every worker is done: no test's engine is running now
        shm_hygiene.remove_leftovers(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):
        lanes.first_lanes_first(items)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return lanes.scheduler(config, log)


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
