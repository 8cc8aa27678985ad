"""vLLM engines of several workers: their sizes read from engine.args, a held set per
tensor-parallel rank, and every rung that cannot serve them refusing by name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.engines.vllm.adapter import VllmAdapter
from agent.engines.vllm.cli import VllmFeatures
from agent.engines.vllm.parallel import Parallel
from agent.engines.vllm.plugin import support
from agent.errors import ConfigError, SnapshotError
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.capture import Capture
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.holder import HolderLink, HybridRestore, WarmStart
from agent.supervisor.paths.refill import RefillRestore
from agent.supervisor.paths.restore import FullRestore
from agent.supervisor.paths.standby import StandbyRestore
from agent.supervisor.paths.vllm import VllmSnapshotRestore
from agent.tenant.mapping import HeldSet, HostSpace
from tests.holder_proc import Holder
from tests.test_vllm_plugin import CPU, CUDA, DIGEST, _adapter


@pytest.mark.parametrize(
    ("args", "sizes"),
    [
        ([], (1, 1, 1)),
        (["--tensor-parallel-size", "2"], (2, 1, 1)),
        (["-tp", "4", "--enforce-eager"], (4, 1, 1)),
        (["--tensor-parallel-size=8"], (8, 1, 1)),
        (["-tp=2", "-pp", "2"], (2, 2, 1)),
        (["--pipeline-parallel-size=3", "--data-parallel-size", "2"], (1, 3, 2)),
        (["-dp", "2"], (1, 1, 2)),
        (["--tensor_parallel_size", "2"], (2, 1, 1)),
    ],
)
def test_the_sizes_are_read_from_either_form_of_each_flag(args: list[str], sizes: tuple):
    p = Parallel.of_args(args)
    assert (p.tensor, p.pipeline, p.data) == sizes
    assert p.workers == sizes[0] * sizes[1] * sizes[2]


@pytest.mark.parametrize(
    "args", [["-tp", "two"], ["--tensor-parallel-size=0"], ["-pp"], ["--data-parallel-size", "-1"]]
)
def test_a_size_that_is_not_a_number_of_workers_is_a_configuration_error(
    tmp_path: Path, args: list[str]
):
    with pytest.raises(
        ConfigError,
        match=r"engine\.args: --\w+-parallel-size .* is not a "
        "number of workers",
    ):
        _adapter(tmp_path, CPU, args=args)


def test_one_worker_keeps_the_digest_as_its_key_and_each_rank_has_its_own():
    # An engine of one worker holds its set where it always did: snapshots taken before
    # still name the same regions.
    assert Parallel().held_keys(DIGEST) == [DIGEST] == [support.held_key(DIGEST, 1, 0)]
    assert Parallel(tensor=2).held_keys(DIGEST) == [f"{DIGEST}+tp2.rank0", f"{DIGEST}+tp2.rank1"]


@pytest.mark.parametrize("args", [["-pp", "2"], ["--data-parallel-size=2"]])
def test_pipeline_or_data_parallel_engines_start_cold_without_the_plugin(
    tmp_path: Path, args: list[str]
):
    a = _adapter(tmp_path, CPU, args=["-tp", "2", *args])
    for refusal in (a.holder_refusal(), a.image_refusal()):
        assert refusal is not None and refusal.code is RefusalCode.PARALLEL_UNSUPPORTED
        assert "the engine starts cold" in refusal.detail
    spec = a.launch_spec()
    assert "--worker-extension-cls" not in spec.argv and support.ENABLE_ENV not in spec.env
    assert a.holder_args(tmp_path / "h.sock", DIGEST) == []


def test_on_cuda_a_tensor_parallel_engine_loads_from_disk_until_each_gpus_holder_serves_it(
    tmp_path: Path,
):
    # One holder per GPU, and the agent asks the first GPU's only: the ranks' sets there
    # would sit on one GPU and be read by the others across it.
    a = _adapter(tmp_path, CUDA, args=["-tp", "2"])
    refusal = a.holder_refusal()
    assert refusal is not None and refusal.code is RefusalCode.TENSOR_PARALLEL
    assert "in its own GPU's holder is not built yet" in refusal.detail
    assert not a.plugin_on() and a.holder_args(tmp_path / "h.sock", DIGEST) == []
    assert _adapter(tmp_path, CUDA).holder_refusal() is None  # one worker: held as before


def _commit(holder: Holder, key: str) -> None:
    with holder.client() as c:
        held = HeldSet.create(c, key, {f"{key}/vllm-params-abc": 4096}, HostSpace)
        held.commit()
        held.close()


def _prepare(rung: object) -> Prepared | Refusal:
    return asyncio.run(rung.prepare(Attempt("test")))  # type: ignore[attr-defined]


def _rungs(tmp: Path, features: VllmFeatures) -> tuple[VllmAdapter, list, Capture]:
    """A TP 2 engine's image rungs (no snapshot backend: only what they refuse first
    counts here) and its capture."""
    a = _adapter(tmp, features, args=["--tensor-parallel-size", "2"])
    link = HolderLink(
        a._config.holder, tmp / "run", gpu=lambda: "cpu", digest=lambda: DIGEST, adapter=a
    )
    kw = {
        "snapshotter": None,
        "unavailable": "no backend here",
        "adapter": a,
        "socket": tmp / "e.sock",
        "identity": lambda: None,
        "metrics": None,
        "timeout_s": 1.0,
    }

    def hybrid() -> HybridRestore:
        return HybridRestore(link, **kw)  # type: ignore[arg-type]

    rungs = [
        FullRestore(**kw),
        hybrid(),  # type: ignore[arg-type]
        RefillRestore(hybrid(), link, plans=None),  # type: ignore[arg-type]
        StandbyRestore(hybrid(), snapshotter=None, adapter=a, socket=tmp / "e.sock", timeout_s=1.0),
    ]
    capture = Capture(
        None,
        None,
        a,
        tmp / "e.sock",
        None,
        None,  # type: ignore[arg-type]
        lambda: None,
        1.0,
    )  # type: ignore[arg-type]
    return a, rungs, capture


def _codes(rungs: list) -> dict[str, Refusal]:
    found = {}
    for rung in rungs:
        refusal = _prepare(rung)
        assert isinstance(refusal, Refusal), (rung.name, refusal)
        found[rung.name] = refusal
    return found


def test_on_cuda_a_tensor_parallel_engine_skips_every_image_rung_and_is_not_snapshotted(
    tmp_path: Path,
):
    holder = Holder(tmp_path / "holder")
    try:
        a, rungs, capture = _rungs(tmp_path, CUDA)
        found = _codes(rungs)
        assert {r.code for r in found.values()} == {RefusalCode.TENSOR_PARALLEL}, found
        assert "NVIDIA driver 590" in found["full"].detail
        # vLLM's own snapshot (`vllm snapshot`) serves engines of one worker.
        snap = VllmSnapshotRestore(
            SimpleNamespace(engine_args=("-tp", "2")),
            None,  # type: ignore
            socket=tmp_path / "e.sock",
            identity=lambda: None,  # type: ignore
            features=lambda: CUDA,
            has_gpu=lambda: True,
            metrics=None,
        )  # type: ignore[arg-type]
        refusal = _prepare(snap)
        assert isinstance(refusal, Refusal) and refusal.code is RefusalCode.TENSOR_PARALLEL
        assert "the vllm-snapshot rung serves engines of one worker" in refusal.detail
        assert capture.refusal() == a.image_refusal() == found["full"]
        with pytest.raises(SnapshotError, match="tensor-parallel workers on CUDA"):
            asyncio.run(capture.take(type("E", (), {"pid": 7})(), None))  # type: ignore
    finally:
        holder.stop()


def test_on_cpu_a_tensor_parallel_engine_is_imaged_and_restored_by_the_hybrid_rung_only(
    tmp_path: Path,
):
    holder = Holder(tmp_path / "holder")
    try:
        a, rungs, capture = _rungs(tmp_path, CPU)
        assert a.holder_refusal() is None and a.plugin_on()  # its weights are held
        found = _codes(rungs)
        # full and hybrid look for a snapshot (this test has no backend); refill and the
        # standby serve engines of one worker.
        assert {n: r.code for n, r in found.items()} == {
            "full": RefusalCode.SNAPSHOTS_UNAVAILABLE,
            "hybrid": RefusalCode.SNAPSHOTS_UNAVAILABLE,
            "refill": RefusalCode.TENSOR_PARALLEL,
            "standby": RefusalCode.TENSOR_PARALLEL,
        }, found
        assert "the refill rung serves engines of one worker" in found["refill"].detail
        assert capture.refusal() is None
    finally:
        holder.stop()


def test_a_warm_start_of_a_tensor_parallel_engine_needs_every_ranks_set_held(tmp_path: Path):
    holder = Holder(tmp_path / "holder")
    try:
        a = _adapter(tmp_path, CPU, args=["-tp", "2"])
        link = HolderLink(
            a._config.holder, tmp_path / "run", gpu=lambda: "cpu", digest=lambda: DIGEST, adapter=a
        )
        warm = WarmStart(a, link)
        # The digest's own set is one worker's: not this engine's.
        _commit(holder, DIGEST)
        _commit(holder, support.held_key(DIGEST, 2, 0))
        refusal = _prepare(warm)
        assert isinstance(refusal, Refusal) and refusal.code is RefusalCode.WEIGHTS_NOT_HELD
        _commit(holder, support.held_key(DIGEST, 2, 1))
        ready = _prepare(warm)
        assert isinstance(ready, Prepared), ready
        # Each worker's loader finds its own rank's set by the digest it is given.
        assert ready.plan == tuple(a.holder_args(link.path, DIGEST))
        assert "--load-format" in ready.plan
    finally:
        holder.stop()
