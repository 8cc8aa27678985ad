"""The longest --max-model-len vLLM accepts for a model directory, read from its config."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import ConfigError

# vLLM's derived maximum (vllm/transformers_utils/model_arch_config_convertor.py,
# derive_max_model_len_and_key, 0.25 and 0.32): the smallest of these keys in the model's
# (text) config, then no more than the tokenizer's model_max_length.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "model_max_length", "max_target_positions", "max_sequence_length",
               "max_seq_length", "seq_len")
# What vLLM reads to let a longer --max-model-len through anyway (use with care, it says).
ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# vLLM's human_readable_int (vllm/utils/argparse_utils.py): 1k = 1000, 1K = 1024.
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class ModelLimit:
    """The longest context vLLM will accept for a model, and which setting says so."""

    tokens: int
    source: str  # "config.json max_position_embeddings", ...


def model_limit(model: Path) -> ModelLimit | None:
    """The limit vLLM derives from `model`'s files; None when this cannot tell for sure
    (no readable config.json, no length key, RoPE scaling: vLLM multiplies the limit by the
    scaling factor, and the rules differ by RoPE type), so vLLM decides itself."""
    config = _read_json(model / "config.json")
    if config is None:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if text.get("rope_scaling") or text.get("rope_parameters"):
        return None
    found = [(text[k], k) for k in LENGTH_KEYS if isinstance(text.get(k), int)]
    if not found:
        return None
    tokens, key = min(found)
    limit = ModelLimit(tokens, f"config.json {key}")
    tokenizer = _read_json(model / "tokenizer_config.json") or {}
    tok_max = tokenizer.get("model_max_length")
    if isinstance(tok_max, int) and tok_max < limit.tokens:
        limit = ModelLimit(tok_max, "tokenizer_config.json model_max_length")
    # vLLM lets a length up to the config's own model_max_length through (Command-R).
    own = text.get("model_max_length")
    if isinstance(own, int) and own > limit.tokens:
        limit = ModelLimit(own, "config.json model_max_length")
    return limit


def requested_len(args: Sequence[str]) -> tuple[int, str] | None:
    """--max-model-len from engine.args, as vLLM parses it, and its text; None when absent,
    automatic (-1, auto) or not a number (vLLM's own parser then names it)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith("--max-model-len="):
            value = arg.split("=", 1)[1]
        elif arg == "--max-model-len" and i + 1 < len(args):
            value = args[i + 1]
    if value is None:
        return None
    text = value.strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        return None if n == -1 else (n, value)
    m = _HUMAN.fullmatch(text)
    if m is None:
        return None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix]), value
    if "." in number:
        return None
    return int(number) * _BINARY[suffix], value


def check_max_model_len(model: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse a --max-model-len that vLLM would refuse for this model, before a start.

    vLLM says so only after its import and config load (15 s and more), and under the agent
    every start would fail the same way: this names the limit at `pitstop check-config`."""
    asked = requested_len(args)
    if asked is None or _truthy(env.get(ALLOW_LONG)):
        return
    limit = model_limit(model)
    if limit is None or asked[0] <= limit.tokens:
        return
    raise ConfigError(
        f"engine.args: --max-model-len {asked[1]} is longer than {model} allows "
        f"({limit.source} = {limit.tokens}); vLLM refuses to start with it. Use "
        f"--max-model-len {limit.tokens} or less, or set {ALLOW_LONG}=1 in engine.env if the "
        "model really handles longer sequences")


def _truthy(value: str | None) -> bool:
    # vLLM reads it as a flag: "1"/"true" on; unset, "0" or "false" off.
    return value is not None and value.strip().lower() in ("1", "true")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
