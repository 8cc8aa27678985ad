"""The GPU bench's command line: how many kills each path gets in one call, and how many
tensor-parallel workers vLLM runs with; and what a rung's row is made of."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.engines.vllm.parallel import Parallel

BENCH = Path(__file__).resolve().parent.parent / "bench"


def parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str):
    monkeypatch.syspath_prepend(str(BENCH))
    import vllm_gpu_bench

    monkeypatch.setattr("sys.argv", ["vllm_gpu_bench.py", str(tmp_path), *args])
    return vllm_gpu_bench.parse_args()


def test_hybrid_gets_as_many_kills_as_every_path_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    a = parse(monkeypatch, tmp_path, "--runs", "3")
    assert (a.runs, a.hybrid_runs) == (3, 3)


def test_hybrid_runs_set_apart_from_the_slow_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    a = parse(monkeypatch, tmp_path, "--runs", "1", "--hybrid-runs", "5",
              "--paths", "hybrid,full,vllm-snapshot")
    assert (a.runs, a.hybrid_runs) == (1, 5)
    assert a.paths == ["hybrid", "full", "vllm-snapshot"]


def test_an_unknown_path_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit):
        parse(monkeypatch, tmp_path, "--paths", "hybrid,hybird")
    assert "unknown hybird" in capsys.readouterr().err


def test_the_gpu_bench_runs_tensor_parallel_and_its_rows_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    a = parse(monkeypatch, tmp_path, "--tp", "2")
    import vllm_bench_kit
    import vllm_gpu_bench

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    assert Parallel.of_args(vllm_gpu_bench.engine_args(tmp_path, a, False)).tensor == 2
    row = vllm_bench_kit.summarize(
        "warm", [{"duration_s": 1.5}], {"gib": 1, "command": "c", "tp": a.tp}
    )
    assert row is not None and row["tp"] == 2 and row["path"] == "warm"


def test_a_rungs_first_start_stands_beside_its_recoveries_not_among_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    parse(monkeypatch, tmp_path)
    import vllm_gpu_bench

    ctx = {"gib": 8, "command": "c"}
    r = {"vllm_snapshot_first": {"path": "vllm-snapshot", "duration_s": 57.0},
         "vllm_snapshot": [{"path": "vllm-snapshot", "duration_s": 34.0,
                            "kill_to_answer_s": 34.5}],
         "warm_first": {"path": "warm", "duration_s": 67.0},
         "vllm_preload_first": {"path": "cold", "duration_s": 90.0}}
    row = vllm_gpu_bench.rung_row("vllm-snapshot", r, ctx)
    assert row is not None and row["runs_s"] == [34.0] and row["median_s"] == 34.0
    assert row["first_start_s"] == 57.0 and "from_first_start" not in row
    warm = vllm_gpu_bench.rung_row("warm", r, ctx)
    assert warm is not None and warm["runs_s"] == [67.0] and warm["from_first_start"]
    # A first start that fell to another rung is no figure of this one.
    assert vllm_gpu_bench.rung_row("vllm-preload", r, ctx) is None


def test_a_restore_log_level_reaches_the_agent_and_every_row_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from agent.config import Config

    a = parse(monkeypatch, tmp_path, "--restore-log-level", "4")
    import vllm_bench_kit
    import vllm_gpu_bench

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    cfg = vllm_gpu_bench.base_config(a, tmp_path, {})
    assert Config.model_validate(cfg).snapshots.restore_log_level == 4
    row = vllm_bench_kit.summarize("hybrid", [{"duration_s": 0.9}],
                                   {"gib": 1, "command": "c", "restore_log_level": 4})
    assert row is not None and row["restore_log_level"] == 4
    # Without the option the agent keeps its default level.
    plain = parse(monkeypatch, tmp_path)
    assert "restore_log_level" not in vllm_gpu_bench.base_config(plain, tmp_path, {})["snapshots"]


def test_a_debug_restore_is_one_more_hybrid_kill_apart_from_the_timed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`--debug-restore`: after the timed hybrid kills the agent is reloaded with CRIU's
    debug level for one more, then back to its own; the row keeps that kill apart."""
    a = parse(monkeypatch, tmp_path, "--paths", "hybrid", "--hybrid-runs", "3",
              "--debug-restore")
    import vllm_gpu_bench

    calls: list[tuple] = []

    class FakeAgent:
        cfg: dict = {"snapshots": {"enabled": True}}

        def reload(self, **snapshots: object) -> None:
            calls.append(("reload", snapshots))

    def series(run, agent, key, want, runs, each_s, before=None):
        calls.append(("series", key, want, runs))
        run.result[key] = [{"path": want, "duration_s": 1.0 + len(calls), "stages": {}}]

    monkeypatch.setattr(vllm_gpu_bench, "series", series)
    monkeypatch.setattr(vllm_gpu_bench, "take_snapshot", lambda agent: {"kind": "hybrid"})
    run = vllm_gpu_bench.Run(a=a, result={"gib": 1, "model": "m"}, out_json=tmp_path / "r.json",
                             budget=None, model=tmp_path, work=tmp_path, cfg={},
                             features=None, command="c")
    vllm_gpu_bench.hybrid_and_refill(run, FakeAgent(), [], "gpu", tmp_path, tmp_path)
    assert calls == [("series", "hybrid", "hybrid", 3),
                     ("reload", {"restore_log_level": 4}),
                     ("series", "hybrid_debug", "hybrid", 1),
                     ("reload", {"restore_log_level": 2})]
    # The row's runs are the timed kills; the debug one stands beside them.
    run.save()
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    hybrid = next(r for r in rows if r["path"] == "hybrid")
    assert hybrid["runs_s"] == [run.result["hybrid"][0]["duration_s"]]
    assert hybrid["debug_restore"]["restore_log_level"] == 4
    assert hybrid["debug_restore"]["duration_s"] == run.result["hybrid_debug"][0]["duration_s"]
    assert vllm_gpu_bench.debug_row([]) is None
