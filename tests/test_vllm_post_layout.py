"""The post-processed tensors' layout: moved into one region, read back, mapped onto a new model."""

from __future__ import annotations

import torch
from torch import nn

from agent.engines.vllm.plugin import post


class Tiny(nn.Module):
    """What vLLM's post-processing leaves: a transposed weight, a scale, a buffer, a tie."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4, bias=False)
        self.emb = nn.Embedding(4, 8)
        self.head = nn.Module()
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("table", torch.arange(6, dtype=torch.float32).view(2, 3))
        self.lin.weight = nn.Parameter(torch.randn(4, 8).t(), requires_grad=False)
        self.lin.scale = nn.Parameter(torch.tensor([0.5], dtype=torch.float32))


def _values(m: nn.Module) -> dict[str, tuple]:
    return {n: (t.dtype, tuple(t.shape), tuple(t.stride()), t.detach().clone())
            for n, _, t in post.named_tensors(m)}


def test_every_tensor_moves_into_the_region_keeping_its_values_strides_and_ties():
    m = Tiny()
    want = _values(m)
    layout = post.Layout.of(m)
    raw = torch.zeros(layout.size, dtype=torch.uint8)
    post.move(m, raw, layout)
    base = raw.data_ptr()
    assert post.outside(m, base, layout.size) == []
    got = _values(m)
    for name, (dtype, shape, stride, value) in want.items():
        assert got[name][:3] == (dtype, shape, stride), name
        assert torch.equal(got[name][3], value), name
    assert m.head.weight is m.emb.weight  # the tie is the same Parameter still
    assert m.lin.weight.t().is_contiguous()  # transposed, as the kernel left it


def test_a_model_built_on_meta_maps_the_region_by_its_own_header():
    m = Tiny()
    layout = post.Layout.of(m)
    raw = torch.zeros(layout.size, dtype=torch.uint8)
    post.move(m, raw, layout)
    with torch.device("meta"):
        fresh = Tiny()
    post.register(fresh, raw, post.Layout.read(raw))
    assert post.materialize(fresh, torch.device("cpu")) == []
    assert post.outside(fresh, raw.data_ptr(), layout.size) == []
    for name, (_, _, _, value) in _values(m).items():
        assert torch.equal(_values(fresh)[name][3], value), name


def test_a_tensor_outside_the_region_or_without_bytes_is_listed():
    m = Tiny()
    layout = post.Layout.of(m)
    raw = torch.zeros(layout.size, dtype=torch.uint8)
    post.move(m, raw, layout)
    m.register_buffer("late", torch.ones(3))  # made after the load
    with torch.device("meta"):
        m.lin.register_buffer("empty", torch.ones(2))
    assert post.outside(m, raw.data_ptr(), layout.size) == ["late", "lin.empty"]


class PaddingKernel:
    """Like vLLM 0.33's CutlassFP8ScaledMMLinearKernel: its post-processing pads the weight
    and keeps the width before the padding, which every call reads."""

    def __init__(self) -> None:
        self.logical_output_size: int | None = None
        self.backend = "cutlass"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.logical_output_size = layer.weight.shape[1]
        layer.weight = nn.Parameter(nn.functional.pad(layer.weight.data, (0, 4)),
                                    requires_grad=False)


class Method:
    def __init__(self) -> None:
        self.fp8_linear = PaddingKernel()


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Module()
        self.lin.weight = nn.Parameter(torch.randn(8, 12), requires_grad=False)
        self.lin.quant_method = Method()


def test_a_warm_start_gets_back_the_kernel_values_only_the_first_starts_processing_set():
    m = Quantized()
    m.lin.quant_method.fp8_linear.process_weights_after_loading(m.lin)
    layout = post.Layout.of(m)
    raw = torch.zeros(layout.size, dtype=torch.uint8)
    post.move(m, raw, layout)
    with torch.device("meta"):
        fresh = Quantized()
    read = post.Layout.read(raw)
    post.register(fresh, raw, read)
    kernel = fresh.lin.quant_method.fp8_linear
    assert kernel.logical_output_size is None  # what a start from processed weights leaves
    kernel.backend = "rebuilt"  # what the warm start's own processing set again is kept
    assert post.fill_kernel_state(fresh, read.kernels) == [
        "lin.quant_method.fp8_linear.logical_output_size"]
    assert (kernel.logical_output_size, kernel.backend) == (12, "rebuilt")
    assert fresh.lin.weight.shape == (8, 16)


class Int8Kernel:
    """Like vLLM's CPUInt8ScaledMMLinearKernel: its post-processing hands the weight to a
    oneDNN handler, which keeps a pointer to the layer's weight scales."""

    def __init__(self) -> None:
        self.dnnl_handler: object | None = None


class Scheme:
    """Like compressed-tensors' W8A8 int8 scheme, which the layer keeps as `scheme`."""

    def __init__(self) -> None:
        self.kernel = Int8Kernel()


def test_the_tensors_of_a_layer_whose_native_handler_holds_their_address_stay_in_place():
    m = Tiny()
    m.lin.scheme = Scheme()
    m.lin.scheme.kernel.dnnl_handler = object()  # made by post-processing
    keep = post.pinned(m)
    assert keep == {"lin.weight", "lin.scale"}
    scale_at = m.lin.scale.data_ptr()
    layout = post.Layout.of(m, keep)
    raw = torch.zeros(layout.size, dtype=torch.uint8)
    post.move(m, raw, layout)
    # The handler's pointer still names the scale; everything else moved.
    assert m.lin.scale.data_ptr() == scale_at
    assert post.outside(m, raw.data_ptr(), layout.size) == ["lin.scale", "lin.weight"]
    assert post.outside(m, raw.data_ptr(), layout.size, keep) == []
    assert {e.name for e in layout.entries} == {"emb.weight", "head.weight", "table"}


def test_a_layer_without_a_handler_yet_pins_nothing():
    m = Tiny()
    m.lin.scheme = Scheme()  # before post-processing: no handler
    assert post.pinned(m) == frozenset()
