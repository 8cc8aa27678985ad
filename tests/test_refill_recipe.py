"""The refill recipe: checkpoint tensors found in an engine's own layout of them (fused, padded,
aligned), checked against the held bytes' sha256, written and read as a plan, and loaded by the
holder's refill job on the cpu sink and, through a fake driver, the cuda sink."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.holder.backends import Allocation
from agent.holder.paramlayout import ParamLayout, ParamSlot
from agent.holder.plans import RefillPlans
from agent.holder.recipe import check, checkpoint_tensors, recipe_of
from agent.holder.refill import Tuning
from agent.holder.refill.cpu import CpuSink
from agent.holder.refill.job import RefillJob
from agent.holder.weightplan import PlanSource, RefillPlan, build_plan, load_plan, write_plan
from agent.refusal import RefusalCode
from agent.weights import WeightsDigester
from tests.test_holder_refill import write_safetensors

DIGEST = "sha256-" + "ab" * 32
ALIGN = 256

# A module: its parameter's kind of layout, and the sizes of the checkpoint tensors in it (16
# bytes or more: random bytes so few may well occur in another tensor, as no real one does).
modules = st.lists(st.tuples(st.sampled_from(["own", "fused", "padded"]),
                             st.lists(st.integers(16, 3000), min_size=1, max_size=3)),
                   min_size=1, max_size=6)


def engine_layout(spec: list[tuple[str, list[int]]], zero_biases: bool
                  ) -> tuple[dict[str, bytes], ParamLayout, bytes]:
    """Checkpoint tensors, and the region an engine makes of them: one parameter per module
    (its own tensor; several fused, as qkv_proj; one padded with zeros, as a vocabulary),
    back to back in name order, each on an ALIGN boundary, zeros between."""
    tensors: dict[str, bytes] = {}
    params: dict[str, bytes] = {}
    for m, (kind, sizes) in enumerate(spec):
        parts = sizes if kind == "fused" else sizes[:1]
        names = [f"model.layers.{m}.attn.{'qkv'[i]}_proj.weight" for i in range(len(parts))]
        for name, n in zip(names, parts, strict=True):
            # Equal tensors (zeros, as biases often are) each go to a place of their own.
            tensors[name] = bytes(n) if zero_biases else os.urandom(n)
        if kind == "own":
            params[names[0]] = tensors[names[0]]
        elif kind == "fused":
            params[f"model.layers.{m}.attn.qkv_proj.weight"] = b"".join(
                tensors[n] for n in names)
        else:
            params[names[0]] = tensors[names[0]] + bytes(101)
    slots, region, at = [], bytearray(), 0
    for name in sorted(params):
        at = -(-at // ALIGN) * ALIGN
        region += bytes(at - len(region)) + params[name]
        slots.append(ParamSlot(name, at, len(params[name])))
        at += len(params[name])
    region += bytes(-len(region) % ALIGN)
    return tensors, ParamLayout(f"{DIGEST}/vllm-params-test", len(region), tuple(slots)), \
        bytes(region)


def refill(plan: RefillPlan, sink_and_allocations: tuple) -> None:
    sink, allocations = sink_and_allocations
    ended = threading.Event()
    job = RefillJob(plan, allocations, sink, on_done=ended.set,
                    tuning=Tuning(threads=2, piece=1 << 12))
    job.start()
    assert ended.wait(60)
    assert job.error is None, job.error


def cpu_sink(size: int) -> tuple[CpuSink, list[Allocation], int]:
    fd = os.memfd_create("recipe-test")
    os.ftruncate(fd, size)
    return CpuSink(), [Allocation(fds=[fd], chunks=[size])], fd


def cuda_sink(size: int) -> tuple[object, list[Allocation]]:
    from agent.holder.refill.cuda import CudaSink
    from tests.fake_cuda import FakeCuda

    # Memory that holds something: the recipe's zeros must be written, not assumed.
    a = Allocation(fds=[], chunks=[size], handle=[bytearray(b"\xee" * size)])
    return CudaSink(SimpleNamespace(ordinal=0, align=ALIGN), Tuning(threads=2, piece=1 << 12),
                    driver=FakeCuda()), [a]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=modules, zero_biases=st.booleans())
def test_a_recipe_rebuilds_any_fused_padded_aligned_layout_and_the_holder_loads_it(
        spec: list[tuple[str, list[int]]], zero_biases: bool):
    tensors, layout, region = engine_layout(spec, zero_biases)
    with tempfile.TemporaryDirectory() as tmp:
        model, holder = Path(tmp) / "model", Path(tmp) / "holder"
        model.mkdir()
        holder.mkdir()
        write_safetensors(model / "model.safetensors", tensors)
        (model / "config.json").write_text("{}")
        made, placed = recipe_of(layout, len(region), iter([memoryview(region)]), model,
                                 checkpoint_tensors(model))
        assert made.sha256 == hashlib.sha256(region).hexdigest()
        assert check(made, model) is None
        # Zeros may go to any zeros; distinct bytes only to their own place.
        assert zero_biases or placed == set(tensors)
        # Written and read back as a plan of the model's files, whose drift is none.
        d = WeightsDigester(None).digest(model)
        files = build_plan(model, d.files, d.digest)
        plan = RefillPlan(digest=d.digest, model=str(model), files=files.files,
                          regions=[made.model_copy(update={"name": f"{d.digest}/p"})],
                          source=PlanSource.RECIPE)
        write_plan(holder, plan)
        assert load_plan(holder) == plan and plan.drift() is None
        # The refill job loads it: on the cpu sink, and on the cuda sink's code path.
        sink, allocations, fd = cpu_sink(len(region))
        refill(plan, (sink, allocations))
        assert os.pread(fd, len(region), 0) == region
        os.close(fd)
        sink2, allocations2 = cuda_sink(len(region))
        refill(plan, (sink2, allocations2))
        assert bytes(allocations2[0].handle[0]) == region


def test_a_recipe_that_does_not_rebuild_the_held_bytes_is_refused_with_its_reason(
        tmp_path: Path):
    tensors, layout, region = engine_layout([("fused", [500, 300, 300]), ("own", [700])],
                                            zero_biases=False)
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(model / "model.safetensors", tensors)
    good, _ = recipe_of(layout, len(region), iter([memoryview(region)]), model,
                        checkpoint_tensors(model))
    assert check(good, model) is None
    # A part read one byte off in its file: other bytes than the ones held.
    parts = list(good.parts or ())
    parts[0] = parts[0].model_copy(update={"at": parts[0].at + 1})
    refused = check(good.model_copy(update={"parts": tuple(parts)}), model)
    assert refused is not None and refused.code is RefusalCode.NO_REFILL_RECIPE
    assert good.sha256 in refused.detail
    # An engine that transformed a tensor on its way in (here: reversed its bytes): that
    # tensor is found nowhere, and the rebuild is not the held region.
    own = next(s for s in layout.slots if s.name.endswith("q_proj.weight"))
    changed = bytearray(region)
    changed[own.offset:own.offset + own.nbytes] = region[own.offset:own.offset + own.nbytes][::-1]
    made, placed = recipe_of(layout, len(changed), iter([memoryview(bytes(changed))]), model,
                             checkpoint_tensors(model))
    assert "model.layers.1.attn.q_proj.weight" not in placed
    refused = check(made, model)
    assert refused is not None and refused.code is RefusalCode.NO_REFILL_RECIPE


def test_a_pulled_image_without_a_recipe_or_of_other_weights_gets_no_refill_plan(
        tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(model / "model.safetensors", {"w": os.urandom(1000)})
    plans = RefillPlans(model, digester=WeightsDigester(None))
    none = plans.from_recipe(tmp_path, None, DIGEST)
    assert not isinstance(none, RefillPlan) and none.code is RefusalCode.NO_REFILL_RECIPE
    d = WeightsDigester(None).digest(model)
    other = RefillPlan(digest=DIGEST, model="/elsewhere", files=[], regions=[],
                       source=PlanSource.RECIPE).model_dump(mode="json")
    refused = plans.from_recipe(tmp_path, other, d.digest)
    assert not isinstance(refused, RefillPlan) and refused.code is RefusalCode.WEIGHTS_CHANGED
    assert load_plan(tmp_path) is None



def test_a_float32_tensor_the_engine_holds_in_bf16_is_cast_as_torch_casts_it(tmp_path: Path):
    import struct

    from agent.holder.casts import Cast

    # Round to nearest even at the halfway points, NaN as torch's one bf16 NaN.
    halfway_even, halfway_odd = 0x3F808000, 0x3F818000
    f32 = struct.pack("<4I", 0x3F800000, halfway_even, halfway_odd, 0x7FC00001)
    assert struct.unpack("<4H", Cast.F32_BF16.apply(f32)) == (0x3F80, 0x3F80, 0x3F82, 0x7FC0)
    # A model whose float32 weights the engine holds in bf16: found cast, and loaded cast.
    model = tmp_path / "model"
    model.mkdir()
    weights = os.urandom(4 * 1000)
    header = {"w.weight": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}
    raw = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + weights)
    region = Cast.F32_BF16.apply(weights) + bytes(48)
    layout = ParamLayout(f"{DIGEST}/vllm-params-test", len(region),
                         (ParamSlot("w.weight", 0, 2000),))
    made, placed = recipe_of(layout, len(region), iter([memoryview(region)]), model,
                             checkpoint_tensors(model))
    assert placed == {"w.weight"} and check(made, model) is None
    assert [p.cast for p in made.parts or ()] == [Cast.F32_BF16]
    d = WeightsDigester(None).digest(model)
    plan = RefillPlan(digest=d.digest, model=str(model),
                      files=build_plan(model, d.files, d.digest).files,
                      regions=[made.model_copy(update={"name": f"{d.digest}/p"})],
                      source=PlanSource.RECIPE)
    sink, allocations, fd = cpu_sink(len(region))
    refill(plan, (sink, allocations))
    assert os.pread(fd, len(region), 0) == region
    os.close(fd)
