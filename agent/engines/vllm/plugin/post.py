"""What vLLM serves from after its post-processing: laid out, moved into held memory, mapped."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")

# Every storage starts on this boundary: enough for any dtype and for vectorised kernels.
ALIGN = 256
# The region starts with the layout: its length (8 bytes, little-endian), then JSON.
_LEN = struct.Struct("<Q")
# A kernel attribute worth carrying from the start that post-processed to a warm start.
Scalar = int | float | bool | str


def named_tensors(model: Any) -> Iterator[tuple[str, str, Any]]:
    """(name, "param" or "buffer", tensor) for every tensor the model reaches by name, tied
    names included (as vLLM's weight-cache daemon exports them)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        yield name, "param", p
    for name, b in model.named_buffers(remove_duplicate=False):
        yield name, "buffer", b


def signature(model: Any, vllm_version: str, quant: str) -> str:
    """What fixes the post-processed tensors: vLLM's version, the quantization method and
    every tensor of the freshly built model (name, kind, dtype, shape). Built on the meta
    device or on the real one, the same model has the same signature."""
    h = hashlib.sha256(f"{vllm_version}\n{quant}".encode())
    for name, kind, t in sorted(named_tensors(model), key=lambda x: x[0]):
        h.update(f"\n{name} {kind} {t.dtype} {tuple(t.shape)}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Entry:
    """One tensor by name: which held storage it views, and how."""

    name: str
    kind: str
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int      # in elements, into its storage (as torch's storage_offset)
    storage: int     # the index of its storage in Layout.storages


@dataclass(frozen=True)
class Layout:
    """The post-processed model's storages back to back after a header that describes
    them; each tensor a view of one, with the strides vLLM's kernels left it (a transposed
    weight stays transposed)."""

    storages: tuple[tuple[int, int], ...]  # (offset in the region, bytes)
    entries: tuple[Entry, ...]
    header: bytes
    size: int
    # What post-processing set on the layers' kernel objects besides tensors (kernel_state).
    kernels: Mapping[str, Mapping[str, Scalar]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: Any, keep: frozenset[str] = frozenset()) -> Layout:
        """The layout of every tensor of `model` but those named in `keep` (`pinned`)."""
        by_ptr: dict[int, int] = {}
        sizes: list[int] = []
        entries: list[Entry] = []
        for name, kind, t in named_tensors(model):
            if t.device.type == "meta" or name in keep:
                continue
            st = t.untyped_storage()
            idx = by_ptr.setdefault(st.data_ptr(), len(sizes))
            if idx == len(sizes):
                sizes.append(st.nbytes())
            entries.append(Entry(name, kind, str(t.dtype).removeprefix("torch."),
                                 tuple(t.shape), tuple(t.stride()), t.storage_offset(), idx))
        return cls.build(sizes, entries, kernel_state(model))

    @classmethod
    def build(cls, sizes: list[int], entries: list[Entry],
              kernels: Mapping[str, Mapping[str, Scalar]] | None = None) -> Layout:
        kernels = kernels or {}
        body = json.dumps({"storages": sizes, "entries": [
            [e.name, e.kind, e.dtype, list(e.size), list(e.stride), e.offset, e.storage]
            for e in entries], "kernels": kernels}, separators=(",", ":")).encode()
        header = _LEN.pack(len(body)) + body
        at = _up(len(header))
        storages = []
        for n in sizes:
            storages.append((at, n))
            at = _up(at + n)
        return cls(tuple(storages), tuple(entries), header, max(at, ALIGN), kernels)

    @classmethod
    def read(cls, raw: Any) -> Layout:
        """The layout a held region starts with (`raw`: the region as uint8)."""
        (n,) = _LEN.unpack(bytes(raw[:_LEN.size].cpu().numpy()))
        doc = json.loads(bytes(raw[_LEN.size:_LEN.size + n].cpu().numpy()))
        entries = [Entry(name, kind, dtype, tuple(size), tuple(stride), off, st)
                   for name, kind, dtype, size, stride, off, st in doc["entries"]]
        # A set held before kernel state was recorded has none: nothing to fill in.
        return cls.build(list(doc["storages"]), entries, doc.get("kernels", {}))


def _kernels(model: Any) -> Iterator[tuple[str, Any]]:
    """("layer.quant_method.attribute", kernel object) for every kernel a layer's quantization
    method keeps (vLLM names their classes ...Kernel: `fp8_linear`, a
    CutlassFP8ScaledMMLinearKernel, say)."""
    for mname, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        for attr, obj in (vars(qm).items() if qm is not None and hasattr(qm, "__dict__")
                          else ()):
            if type(obj).__name__.endswith("Kernel") and hasattr(obj, "__dict__"):
                yield f"{mname}.quant_method.{attr}", obj


def kernel_state(model: Any) -> dict[str, dict[str, Scalar]]:
    """The plain values (numbers, flags, strings) each layer's kernel objects hold after
    post-processing. Some kernels set one there from the weights they transform (vLLM 0.33's
    CutlassFP8ScaledMMLinearKernel its `logical_output_size`, the width before its padding)
    and read it on every call; a start from the post-processed weights does not run that
    transform, so only the start that did can say it."""
    out: dict[str, dict[str, Scalar]] = {}
    for name, k in _kernels(model):
        plain = {a: v for a, v in vars(k).items()
                 if not a.startswith("_") and isinstance(v, int | float | bool | str)}
        if plain:
            out[name] = plain
    return out


def fill_kernel_state(model: Any, kernels: Mapping[str, Mapping[str, Scalar]]) -> list[str]:
    """Give each kernel object of `model` the values `kernels` recorded that it still lacks
    (None) after a start from post-processed weights; what vLLM set again itself is kept.
    The `kernel.attribute` names filled."""
    filled = []
    for name, k in _kernels(model):
        for attr, value in kernels.get(name, {}).items():
            if hasattr(k, attr) and getattr(k, attr) is None:
                setattr(k, attr, value)
                filled.append(f"{name}.{attr}")
    return filled


def _holds_addresses(obj: Any) -> bool:
    # vLLM's CPU oneDNN kernels keep their handler (a C++ object) here.
    return getattr(obj, "dnnl_handler", None) is not None


def pinned(model: Any) -> frozenset[str]:
    """Tensors native code holds by address after post-processing, which must not move.

    vLLM's CPU int8 kernel (CPUInt8ScaledMMLinearKernel, compressed-tensors W8A8) prepacks
    the weight into a oneDNN handler but keeps a pointer to the weight scales
    (`create_onednn_scaled_mm_handler` in vLLM's csrc/cpu/dnnl_kernels.cpp); moved into held
    memory, the handler would read the freed copy, zeros once it was given back. Every
    tensor of such a layer stays where it is, in the engine's own memory and so its image
    (the weight lives in the handler there too); a restore puts it back at its address."""
    out = set()
    for mname, m in model.named_modules():
        methods = [o for o in (getattr(m, "quant_method", None), getattr(m, "scheme", None))
                   if o is not None]
        held_by = [*methods, *(v for o in methods if hasattr(o, "__dict__")
                               for v in vars(o).values())]
        if any(_holds_addresses(o) for o in held_by):
            for leaf, t in [*m._parameters.items(), *m._buffers.items()]:
                if t is not None:
                    out.add(f"{mname}.{leaf}" if mname else leaf)
    return frozenset(out)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _view(raw: Any, layout: Layout, e: Entry) -> Any:
    import torch

    at, _ = layout.storages[e.storage]
    dtype = getattr(torch, e.dtype)
    base = raw.storage_offset() + at
    return torch.empty(0, dtype=dtype, device=raw.device).set_(
        raw.untyped_storage(), base // dtype.itemsize + e.offset, e.size, e.stride)


def move(model: Any, raw: Any, layout: Layout) -> None:
    """Copy each storage into its slot of `raw` and make every tensor on it a view there,
    one storage at a time: the engine's own copy of each is freed as soon as nothing else
    holds it, so the model is never there twice. Parameters keep their objects (and the
    attributes vLLM set on them); buffers are re-registered."""
    import torch

    modules = dict(model.named_modules(remove_duplicate=False))
    raw[:len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
    by_storage: dict[int, list[Entry]] = {}
    for e in layout.entries:
        by_storage.setdefault(e.storage, []).append(e)
    for idx, group in by_storage.items():
        at, n = layout.storages[idx]
        first = _get(modules, group[0].name)
        src = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), 0, (n,), (1,))
        raw[at:at + n].copy_(src)
        del src, first
        for e in group:
            _rebind(modules, e.name, e.kind, _view(raw, layout, e), keep=True)


def register(model: Any, raw: Any, layout: Layout) -> None:
    """Make every tensor the layout names a view of held memory in `model` (built on the
    meta device): what a warm start serves from, no weight read from disk."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for e in layout.entries:
        _rebind(modules, e.name, e.kind, _view(raw, layout, e), keep=False)


def materialize(model: Any, device: Any) -> list[str]:
    """Tensors still on the meta device after a warm start's post-processing (ones the
    first start's post-processing dropped): given empty storage, as vLLM's IPC loader does;
    their names."""
    import torch
    from torch import nn

    left = []
    for mname, m in model.named_modules():
        for leaf, p in list(m._parameters.items()):
            if p is not None and p.device.type == "meta":
                m._parameters[leaf] = nn.Parameter(torch.empty_like(p, device=device),
                                                   requires_grad=False)
                left.append(f"{mname}.{leaf}")
        for leaf, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[leaf] = torch.empty_like(b, device=device)
                left.append(f"{mname}.{leaf}")
    return left


def outside(model: Any, base: int, size: int, keep: frozenset[str] = frozenset()) -> list[str]:
    """Every parameter and buffer with bytes whose storage is not in [base, base + size):
    what the engine reads from its own memory, so from a snapshot's image, not the holder;
    but those `keep` names (`pinned`: in the image by design, not by accident)."""
    # A tensor still on the meta device has no bytes at all: listed too.
    return sorted({name for name, _, t in named_tensors(model)
                   if name not in keep and t.numel()
                   and (t.device.type == "meta"
                        or not base <= t.untyped_storage().data_ptr() < base + size)})


def _get(modules: dict[str, Any], name: str) -> Any:
    mname, _, leaf = name.rpartition(".")
    m = modules[mname]
    return m._parameters[leaf] if leaf in m._parameters else m._buffers[leaf]


def _rebind(modules: dict[str, Any], name: str, kind: str, t: Any, keep: bool) -> None:
    from torch import nn

    mname, _, leaf = name.rpartition(".")
    m = modules[mname]
    if kind == "param":
        p = m._parameters.get(leaf)
        if keep and p is not None:
            p.data = t  # the same Parameter: anything that holds it sees held memory
        else:
            m._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    else:
        m._buffers[leaf] = t
