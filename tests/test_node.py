"""Several engines on one node: their files checked against each other, `pitstop status` of
each, and the engine's name on every metric its agent serves."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.errors import ConfigError
from agent.metrics import EngineLabel, Metrics, NodeInfo, StatusView, new_registry
from agent.metrics_endpoint import MetricsEndpoint
from agent.node import check_name, conflicts, gpu_claim, load_engine, load_engines
from agent.supervisor.status import AgentStatus, StatusFile

REPO = Path(__file__).resolve().parent.parent


def _pitstop(*args: str) -> subprocess.CompletedProcess[str]:
    # The worktree's code, whichever checkout the venv was installed from.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def _engine(d: Path, name: str, *, front: int, metrics: int | None = None,
            state: str | None = None, run: str | None = None, device: str = "cuda",
            args: list[str] | None = None, gpus: str | None = None, kind: str = "vllm") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    state = state or str(d.parent / "state" / name)
    engine: dict = {"kind": kind, "model": "/m", "device": device, "args": args or []}
    if gpus is not None:
        engine["env"] = {"CUDA_VISIBLE_DEVICES": gpus}
    doc = {"engine": engine, "front": {"port": front},
           "metrics": {"port": metrics if metrics is not None else front + 1000},
           "paths": {"state_dir": state, "run_dir": run or f"{state}/run"}}
    f = d / f"{name}.yaml"
    f.write_text(json.dumps(doc))
    return f


def test_engines_that_share_nothing_pass(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    for i, name in enumerate(("a", "b", "c")):
        _engine(d, name, front=8001 + i, gpus=str(i))
    assert conflicts(load_engines(d)) == []


def test_two_engines_on_one_port_are_named_both(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    a = _engine(d, "a", front=8001, gpus="0")
    b = _engine(d, "b", front=9002, metrics=8001, gpus="1")
    [c] = conflicts(load_engines(d))
    assert str(c).startswith(f"{a} and {b} both listen on port 8001 (front.port of a on "
                             "127.0.0.1, metrics.port of b on 127.0.0.1)")


def test_a_listener_on_every_address_clashes_with_one_on_loopback(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    _engine(d, "a", front=8001, gpus="0")
    f = _engine(d, "b", front=8001, metrics=9002, gpus="1")
    f.write_text(f.read_text().replace('"front": {"port": 8001}',
                                       '"front": {"port": 8001, "host": "0.0.0.0"}'))
    [c] = conflicts(load_engines(d))
    assert "both listen on port 8001 (front.port of a on 127.0.0.1, front.port of b on " \
        "0.0.0.0)" in str(c)


def test_port_0_never_clashes(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    _engine(d, "a", front=0, metrics=0, gpus="0")
    _engine(d, "b", front=0, metrics=0, gpus="1")
    assert conflicts(load_engines(d)) == []


def test_two_engines_in_one_state_directory_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    a = _engine(d, "a", front=8001, state="/var/lib/pitstop", run="/run/pitstop/a", gpus="0")
    b = _engine(d, "b", front=8002, state="/var/lib/pitstop", run="/run/pitstop/b", gpus="1")
    found = [str(c) for c in conflicts(load_engines(d))]
    assert f"{a} and {b} both use /var/lib/pitstop (paths.state_dir of a, paths.state_dir " \
        "of b)" in found[0]
    # The snapshot directory under it is the same one too.
    assert any("/var/lib/pitstop/snapshots" in c for c in found)


def test_one_engines_run_directory_as_anothers_state_directory_is_refused(tmp_path: Path):
    d = tmp_path / "engines"
    _engine(d, "a", front=8001, state="/srv/a", run="/srv/b", gpus="0")
    _engine(d, "b", front=8002, state="/srv/b", run="/run/b", gpus="1")
    [c] = conflicts(load_engines(d))
    assert "both use /srv/b (paths.run_dir of a, paths.state_dir of b)" in str(c)


def test_shares_of_one_gpu_beyond_its_size_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    a = _engine(d, "a", front=8001, gpus="0", args=["--gpu-memory-utilization", "0.6"])
    b = _engine(d, "b", front=8002, gpus="0", args=["--gpu-memory-utilization=0.5"])
    [c] = conflicts(load_engines(d))
    assert str(c) == (f"{a} and {b} share GPU 0 and claim 1.10 of its memory "
                      "(--gpu-memory-utilization: a 0.6, b 0.5); lower their "
                      "--gpu-memory-utilization so that they add up to at most 1")


def test_shares_that_fit_one_gpu_pass(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    _engine(d, "a", front=8001, gpus="0", args=["--gpu-memory-utilization", "0.45"])
    _engine(d, "b", front=8002, gpus="0", args=["--gpu-memory-utilization", "0.45"])
    assert conflicts(load_engines(d)) == []


def test_vllm_without_a_share_takes_its_default_and_two_of_them_do_not_fit(tmp_path: Path):
    d = tmp_path / "engines"
    _engine(d, "a", front=8001, gpus="0")
    _engine(d, "b", front=8002, gpus="0")
    [c] = conflicts(load_engines(d))
    assert "claim 1.80 of its memory" in str(c)


def test_a_tensor_parallel_engine_claims_its_first_gpus(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    big = _engine(d, "big", front=8001, gpus="0,1,2,3",
                  args=["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9"])
    assert gpu_claim(load_engine(big).config).gpus == ("0", "1")
    _engine(d, "small", front=8002, gpus="2", args=["--gpu-memory-utilization", "0.9"])
    assert conflicts(load_engines(d)) == []
    _engine(d, "clash", front=8003, gpus="1", args=["-tp", "1", "--gpu-memory-utilization",
                                                    "0.2"])
    [c] = conflicts(load_engines(d))
    assert "share GPU 1 and claim 1.10" in str(c)


def test_a_tensor_parallel_size_in_any_of_vllms_spellings_claims_as_many_gpus(
        tmp_path: Path) -> None:
    d = tmp_path / "engines"
    for name, tp in (("eq", ["-tp=3"]), ("under", ["--tensor_parallel_size", "3"])):
        f = _engine(d, name, front=0, gpus="0,1,2,3", args=[*tp, "--gpu-memory-utilization",
                                                             "0.4"])
        assert gpu_claim(load_engine(f).config).gpus == ("0", "1", "2")


def test_a_tensor_parallel_size_that_is_not_a_number_is_named(tmp_path: Path) -> None:
    f = _engine(tmp_path / "engines", "a", front=8001, args=["-tp", "two"])
    with pytest.raises(ConfigError, match="--tensor-parallel-size 'two' is not a number"):
        gpu_claim(load_engine(f).config)


def test_gpus_named_both_ways_on_one_node_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    _engine(d, "a", front=8001, gpus="0")
    _engine(d, "b", front=8002, gpus="GPU-8b3c2f1e-0000-1111-2222-333344445555")
    [c] = conflicts(load_engines(d))
    assert "both by index and by UUID" in str(c)


def test_engines_on_cpu_and_reference_engines_without_a_share_claim_no_gpu(tmp_path: Path):
    d = tmp_path / "engines"
    cpu = _engine(d, "a", front=8001, device="cpu", kind="reference")
    ref = _engine(d, "b", front=8002, kind="reference")
    assert gpu_claim(load_engine(cpu).config) is None
    assert gpu_claim(load_engine(ref).config) is None


def test_a_share_that_is_not_a_number_is_named(tmp_path: Path) -> None:
    f = _engine(tmp_path / "engines", "a", front=8001, args=["--gpu-memory-utilization", "most"])
    with pytest.raises(ConfigError, match="--gpu-memory-utilization 'most' is not a number"):
        gpu_claim(load_engine(f).config)


@pytest.mark.parametrize("name", ["a", "llama-8b", "qwen3_0.6b", "GPU0"])
def test_engine_names_that_name_a_unit_a_file_and_a_label(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a b", "a/b", "a@b", "..", "x" * 65])
def test_engine_names_that_would_be_mangled_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="engine name"):
        check_name(name)


def test_check_config_names_both_files_of_a_clash_and_exits_2(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    a = _engine(d, "a", front=8001, gpus="0")
    b = _engine(d, "b", front=8001, gpus="1")
    r = _pitstop("check-config", "--engines-dir", str(d))
    assert r.returncode == 2
    assert f"pitstop: {a} and {b} both listen on port 8001" in r.stderr, r.stderr
    # Files given by name are checked as one node the same way.
    r = _pitstop("check-config", str(a), str(b))
    assert r.returncode == 2 and f"{a} and {b}" in r.stderr


def test_check_config_of_a_node_that_fits(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    a = _engine(d, "a", front=8001, gpus="0")
    _engine(d, "b", front=8002, gpus="1")
    r = _pitstop("check-config", "--engines-dir", str(d))
    assert r.returncode == 0, r.stderr
    assert f"{a}: ok (engine vllm, model /m)" in r.stdout
    assert "2 engines (a, b): no port, directory or GPU memory claimed twice" in r.stdout


def test_check_config_of_one_new_file_against_the_nodes_other_engines(tmp_path: Path) -> None:
    """What the Ansible role runs before a new file replaces engine a's."""
    d = tmp_path / "engines"
    _engine(d, "a", front=8001, gpus="0")
    b = _engine(d, "b", front=8002, gpus="1")
    new = _engine(tmp_path / "staged", "a", front=8002, gpus="0")
    r = _pitstop("check-config", str(new), "--engine", "a", "--engines-dir", str(d))
    assert r.returncode == 2
    assert f"{new} and {b} both listen on port 8002" in r.stderr, r.stderr
    fine = _engine(tmp_path / "staged2", "a", front=8003, gpus="0")
    r = _pitstop("check-config", str(fine), "--engine", "a", "--engines-dir", str(d))
    assert r.returncode == 0, r.stderr


def test_check_config_of_one_file_still_names_its_bad_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {model: /m}\nbogus: 1\n")
    r = _pitstop("check-config", str(bad))
    assert r.returncode == 2 and "bogus: unknown key" in r.stderr


def test_an_engine_file_with_a_bad_name_is_named(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    _engine(d, "a", front=8001)
    (d / "a b.yaml").write_text("engine: {model: /m}\n")
    r = _pitstop("check-config", "--engines-dir", str(d))
    assert r.returncode == 2 and f"{d / 'a b.yaml'}: engine name 'a b'" in r.stderr


def _write_status(config: Path, **fields: object) -> None:
    cfg = load_engine(config).config
    cfg.paths.run.mkdir(parents=True, exist_ok=True)
    # This process stands in for the running agent: status.json names a live PID.
    StatusFile(cfg.paths.run / "status.json").write(AgentStatus(**fields))  # type: ignore[arg-type]


def test_status_lists_every_engine_and_one_with_engine(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    a = _engine(d, "a", front=8001, device="cpu", kind="reference")
    b = _engine(d, "b", front=8002, device="cpu", kind="reference")
    _engine(d, "c", front=8003, device="cpu", kind="reference")
    _write_status(a, engine="a", state="ready", engine_kind="reference", engine_pid=11)
    _write_status(b, engine="b", state="backoff", reason="engine exited", engine_kind="reference")
    r = _pitstop("status", "--engines-dir", str(d))
    assert r.returncode == 1  # not every engine is ready
    assert "engine a\n  state:    ready\n  engine:   reference, pid 11" in r.stdout, r.stdout
    assert "engine b\n  state:    backoff (engine exited)" in r.stdout
    assert "engine c\n  state:    unknown (no agent status at" in r.stdout
    every = json.loads(_pitstop("status", "--json", "--engines-dir", str(d)).stdout)
    assert {n: s["state"] for n, s in every["engines"].items()} == \
        {"a": "ready", "b": "backoff", "c": "unknown"}
    one = _pitstop("status", "--engine", "a", "--json", "--engines-dir", str(d))
    assert one.returncode == 0
    assert json.loads(one.stdout)["engine"] == "a"


def test_status_of_an_unknown_engine_says_which_file_it_looked_for(tmp_path: Path) -> None:
    d = tmp_path / "engines"
    _engine(d, "a", front=8001)
    r = _pitstop("status", "--engine", "zz", "--engines-dir", str(d))
    assert r.returncode == 2
    assert f"{d / 'zz.yaml'}: cannot read the configuration file" in r.stderr


def _view() -> StatusView:
    return StatusView(state="ready", engine_up=True, engine_start_time=None,
                      states=("ready", "stopped"), node=NodeInfo(engine="a", model="tiny"))


def _scrape(port: int, query: str = "") -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics{query}", timeout=10) \
        .read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_every_metric_an_engines_agent_serves_carries_the_engine() -> None:
    registry = new_registry()
    m = Metrics(registry, _view)
    m.recoveries.labels(path="full", result="success", cause="crash").inc()

    async def scrape_both() -> tuple[dict, dict]:
        # The agent's own endpoint, as agent/wiring.py builds it for engine "a".
        ep = MetricsEndpoint(EngineLabel.over(registry, "a"), "127.0.0.1", 0)
        await ep.start()
        try:
            every = await asyncio.to_thread(_scrape, ep.port)
            # A scrape that names the metrics it wants gets them labelled too.
            some = await asyncio.to_thread(_scrape, ep.port,
                                           "?name[]=pitstop_engine_failures_total")
            return every, some
        finally:
            await ep.stop()

    families, some = asyncio.run(scrape_both())
    samples = [s for ss in families.values() for s in ss]
    assert samples and all(s.labels.get("engine") == "a" for s in samples)
    [info] = families["pitstop_node_info"]
    assert info.labels["model"] == "tiny"
    [up] = families["pitstop_engine_up"]
    assert up.labels == {"engine": "a"} and up.value == 1
    assert {s.labels["engine"] for s in some["pitstop_engine_failures"]} == {"a"}
    # The registry itself, which the agent's code and tests read, carries no engine label.
    assert registry.get_sample_value("pitstop_recoveries_total",
                                     {"path": "full", "result": "success", "cause": "crash"}) == 1


def test_the_one_agent_of_a_node_serves_its_metrics_unlabelled() -> None:
    registry = new_registry()
    assert EngineLabel.over(registry, "") is registry


def test_one_file_checked_by_itself_may_have_any_name(tmp_path: Path) -> None:
    """Ansible's validate: the new file is a temporary one, `.source` say."""
    f = _engine(tmp_path, "x", front=8001)
    tmp = f.rename(tmp_path / ".source")
    r = _pitstop("check-config", str(tmp))
    assert r.returncode == 0, r.stderr
