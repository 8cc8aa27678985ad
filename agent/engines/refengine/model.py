"""A Llama forward pass in plain torch (RMSNorm, RoPE, GQA, SwiGLU) over safetensors weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agent.errors import ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of a Hugging Face Llama `config.json` that the forward pass needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    dtype: str
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, directory: Path) -> LlamaConfig:
        path = directory / "config.json"
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{path}: cannot read the model config: {e}") from e
        if raw.get("model_type") != "llama":
            raise ModelError(f"{path}: model_type is {raw.get('model_type')!r}, expected 'llama'")
        if raw.get("rope_scaling"):
            raise ModelError(f"{path}: rope_scaling is not supported by the reference engine")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            return cls(
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{path}: missing or invalid key {e}; is this a Llama model?") from e


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if not single.exists():
        raise ModelError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    return [single]


def load_weights(directory: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Every tensor of the model, on `device` in `dtype` (safetensors maps the files)."""
    from safetensors import safe_open

    weights: dict[str, Any] = {}
    for path in _weight_files(directory):
        # Loading on CPU then moving keeps one code path; safetensors mmaps the file.
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return weights


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the model in `directory`."""
    return _weight_files(directory)


def weights_from_held(held: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Held tensors used in place; one of another dtype is converted into the engine's own
    memory (correct, but then its bytes are in a snapshot image again)."""
    out, converted = {}, []
    for name, t in held.items():
        if t.dtype == dtype:
            out[name] = t
        else:
            out[name] = t.to(dtype)
            converted.append(name)
    if converted:
        import logging

        logging.getLogger("refengine").warning(
            "%d held tensors are not %s and were copied (e.g. %s); run with --dtype matching "
            "the files to use the held memory in place", len(converted), dtype, converted[0])
    return out


class Llama:
    """The model: `forward` runs tokens at given positions of one KV slot, returns logits.

    Example::

        model = Llama.load(Path("tiny-llama"), torch.device("cpu"), None)
        pool = KVPool(model.config, slots=2, max_len=256, device=model.device, dtype=model.dtype)
        logits = model.forward([0, 17, 42], start=0, kv=pool.slot_views(0))
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, Any], device: torch.device,
                 cuda_graphs: bool = False) -> None:
        self.config = config
        self.device = device
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self._w = weights
        self._check_shapes()
        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # HF's rotate_half layout
        self._cos = angles.cos().to(device=device, dtype=torch.float32)
        # rotate_half's minus sign folded into the table ((-a) * s == a * (-s) exactly):
        # one kernel fewer per rotation, the same bits.
        sin = angles.sin()
        self._sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(
            device=device, dtype=torch.float32)
        self._graphs = None
        if cuda_graphs and device.type == "cuda":
            from agent.engines.refengine.graphs import GraphSteps

            self._graphs = GraphSteps(self.step_static, device, self.prefill_static)

    @property
    def graphs(self) -> int | None:
        """How many step graphs are captured; None when steps run eagerly."""
        return None if self._graphs is None else len(self._graphs)

    def forget_graphs(self) -> None:
        """Drop captured graphs (the KV pool moved: they would write to the old addresses)."""
        if self._graphs is not None:
            self._graphs.clear()

    @classmethod
    def load(cls, directory: Path, device: torch.device, dtype: str | None,
             held: dict[str, Any] | None = None, cuda_graphs: bool = False) -> Llama:
        """Read the weights from `directory`, or use `held` (tensors over memory the holder
        keeps, already on `device`) when given. `cuda_graphs` replays one-token steps from
        CUDA graphs on a GPU (graphs.py)."""
        config = LlamaConfig.from_dir(directory)
        name = dtype or config.dtype
        if name not in DTYPES:
            raise ModelError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
        if held is None:
            weights = load_weights(directory, device, DTYPES[name])
        else:
            weights = weights_from_held(held, DTYPES[name])
        return cls(config, weights, device, cuda_graphs)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._w.values())

    def _check_shapes(self) -> None:
        c = self.config
        kv = c.num_kv_heads * c.head_dim
        want = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                "lm_head.weight": (c.vocab_size, c.hidden_size)}
        for i in range(c.num_layers):
            want[f"model.layers.{i}.self_attn.k_proj.weight"] = (kv, c.hidden_size)
            want[f"model.layers.{i}.mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        for name, shape in want.items():
            got = self._w.get(name)
            if got is None or tuple(got.shape) != shape:
                found = None if got is None else tuple(got.shape)
                raise ModelError(f"weights: {name} should have shape {shape}, found {found}")

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self._w[name] * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        # x: (heads, T, head_dim); rotate pairs (i, i + half) like HF Llama, whose
        # rotate_half is cat(-x2, x1): here cat(x2, x1) times a sine table that is negative
        # over its first half.
        xf = x.float()
        half = xf.shape[-1] // 2
        swapped = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + swapped * sin_signed).to(x.dtype)

    @torch.inference_mode()
    def forward(self, tokens: list[int], start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        """Logits (float32, on CPU) of the token after `tokens`, which sit at positions
        `start..start+T-1` of the slot whose per-layer (K, V) views are `kv`."""
        if self._graphs is not None and len(tokens) == 1:
            return self._graphs.run(tokens[0], start, kv).float().cpu()
        if self._graphs is not None and start == 0 and self._graphs.can_prefill(len(tokens)):
            return self._graphs.run_prefill(tokens, kv).float().cpu()
        ids = torch.tensor(tokens, device=self.device)
        return self._pass(ids, start, kv).float().cpu()

    @torch.inference_mode()
    def prefill_static(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> torch.Tensor:
        """The eager pass over token ids `ids` (a device tensor) at positions 0..T-1: logits
        in the model dtype, on the device. No host synchronisation: CUDA graphs capture it."""
        return self._pass(ids, 0, kv)

    def _pass(self, ids: torch.Tensor, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> torch.Tensor:
        c = self.config
        t = ids.shape[0]
        end = start + t
        pos = torch.arange(start, end, device=self.device)
        x = self._w["model.embed_tokens.weight"][ids]
        mask = None
        if t > 1:  # causal mask within the chunk; earlier positions are all visible
            q_pos = pos.view(-1, 1).repeat(c.num_heads // c.num_kv_heads, 1)
            mask = torch.arange(end, device=self.device).view(1, -1) > q_pos

        def write(cache: torch.Tensor, values: torch.Tensor) -> None:
            cache[:, start:end] = values

        return self._layers(x, pos, kv, end, mask, write)[0]

    @torch.inference_mode()
    def step_static(self, token: torch.Tensor, position: torch.Tensor,
                    kv: list[tuple[torch.Tensor, torch.Tensor]], span: int) -> torch.Tensor:
        """Logits (model dtype, on the device) of one token whose id and position are
        1-element device tensors; attention runs over the first `span` positions of the
        slot, later ones masked. No host synchronisation: CUDA graphs capture it."""
        x = self._w["model.embed_tokens.weight"][token]
        mask = (torch.arange(span, device=self.device) > position).view(1, span)

        def write(cache: torch.Tensor, values: torch.Tensor) -> None:
            cache.index_copy_(1, position, values)

        return self._layers(x, position, kv, span, mask, write)[0]

    def _layers(self, x: torch.Tensor, pos: torch.Tensor,
                kv: list[tuple[torch.Tensor, torch.Tensor]], span: int,
                mask: torch.Tensor | None,
                write: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """Every layer over `x` (T, hidden) at positions `pos`, then the head of the last
        token: logits (1, vocab). Attention reads positions below `span`; `mask` hides
        those a query must not see."""
        c = self.config
        t = x.shape[0]
        group = c.num_heads // c.num_kv_heads
        # Once a pass, not twice a layer: a decode step is bound by its kernel count.
        cos, sin = self._cos[pos], self._sin_signed[pos]
        heads = c.num_heads
        for i, (k_cache, v_cache) in enumerate(kv):
            p = f"model.layers.{i}."
            h = self._rms_norm(x, p + "input_layernorm.weight")
            q = F.linear(h, self._w[p + "self_attn.q_proj.weight"])
            k = F.linear(h, self._w[p + "self_attn.k_proj.weight"])
            v = F.linear(h, self._w[p + "self_attn.v_proj.weight"])
            # Q and K rotated together: RoPE is elementwise, so one set of its kernels over
            # both gives the bits of two (and Q comes out contiguous, no copy to reshape).
            qk = torch.cat([q.view(t, heads, c.head_dim).transpose(0, 1),
                            k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)])
            qk = self._rope(qk, cos, sin)
            q, k = qk[:heads], qk[heads:]
            write(k_cache, k)
            write(v_cache, v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1))
            # GQA: query head h reads KV head h // group, as HF's repeat_kv does.
            q = q.reshape(c.num_kv_heads, group * t, c.head_dim)
            scores = (q @ k_cache[:, :span].transpose(1, 2)).float() * c.head_dim**-0.5
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            probs = scores.softmax(-1).to(x.dtype)
            attn = (probs @ v_cache[:, :span]).view(c.num_heads, t, c.head_dim)
            attn = attn.transpose(0, 1).reshape(t, c.num_heads * c.head_dim)
            x = x + F.linear(attn, self._w[p + "self_attn.o_proj.weight"])
            h = self._rms_norm(x, p + "post_attention_layernorm.weight")
            gate = F.silu(F.linear(h, self._w[p + "mlp.gate_proj.weight"]))
            up = F.linear(h, self._w[p + "mlp.up_proj.weight"])
            x = x + F.linear(gate * up, self._w[p + "mlp.down_proj.weight"])
        last = self._rms_norm(x[-1:], "model.norm.weight")
        return F.linear(last, self._w["lm_head.weight"])
