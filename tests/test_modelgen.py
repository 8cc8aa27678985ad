"""`pitstop make-model`: the generated directory, its determinism, idempotence and sharding."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from agent import modelgen
from agent.cli import main
from agent.engines.refengine.model import load_weights
from agent.errors import ModelError
from agent.modelgen import RECORD, SPECIAL_TOKENS, VOCAB_SIZE, make_model, record_for, spec_for

pytestmark = pytest.mark.timeout(120)

HF_LAYER_TENSORS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def test_tiny_model_has_the_hugging_face_llama_layout(tiny_model: Path) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (2, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["vocab_size"] == VOCAB_SIZE and cfg["tie_word_embeddings"] is False
    for key in ["rope_theta", "rms_norm_eps", "max_position_embeddings", "torch_dtype",
                "bos_token_id", "eos_token_id", "intermediate_size"]:
        assert key in cfg, key
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (VOCAB_SIZE, 128)
        assert f.get_tensor("model.layers.1.self_attn.k_proj.weight").shape == (64, 128)
    expected = {f"model.layers.{i}.{t}" for i in range(2) for t in HF_LAYER_TENSORS}
    expected |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert names == expected
    assert (tiny_model / "model.safetensors").stat().st_size < 4 << 20

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    ids = tok.encode("The river ran.").ids
    assert ids[0] == cfg["bos_token_id"]
    assert tok.decode(ids, skip_special_tokens=True) == "The river ran."
    tcfg = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<s>", "</s>")
    assert "messages" in tcfg["chat_template"]
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert json.loads((tiny_model / RECORD).read_text()) == record_for(spec_for("tiny"))


def test_chat_template_renders_roles_as_special_tokens(tiny_model: Path) -> None:
    from agent.engines.refengine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model)
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text == "<s><|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [tok.token_id("<s>"), tok.token_id("<|user|>")]


def test_same_parameters_give_identical_files(tmp_path: Path) -> None:
    spec = spec_for("tiny", seed=5)
    assert make_model(tmp_path / "a", spec)
    assert make_model(tmp_path / "b", spec)
    for f in sorted((tmp_path / "a").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dirs left


def test_make_model_is_idempotent_and_refuses_to_clobber(tmp_path: Path) -> None:
    d = tmp_path / "m"
    assert make_model(d, spec_for("tiny"))
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert not make_model(d, spec_for("tiny"))
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ModelError, match="--force"):
        make_model(d, spec_for("tiny", seed=1))
    assert make_model(d, spec_for("tiny", seed=1), force=True)
    assert json.loads((d / RECORD).read_text())["spec"]["seed"] == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="not a model"):
        make_model(foreign, spec_for("tiny"))
    assert (foreign / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "m"]


def test_sharded_weights_hold_the_same_tensors(tmp_path: Path, tiny_model: Path) -> None:
    d = tmp_path / "sharded"
    make_model(d, spec_for("tiny"), shard_bytes=1 << 20)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (d / "model.safetensors").exists()
    cpu = torch.device("cpu")
    a = load_weights(tiny_model, cpu, torch.float32)
    b = load_weights(d, cpu, torch.float32)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("gib", [0.5, 8, 32])
def test_target_size_picks_a_model_of_about_that_size(gib: float) -> None:
    spec = spec_for(target_gib=gib)
    assert spec.dtype == "bfloat16"
    assert abs(spec.weight_bytes() / (gib * (1 << 30)) - 1) < 0.1
    assert spec.num_attention_heads * spec.head_dim == spec.hidden_size
    assert spec.num_attention_heads % spec.num_key_value_heads == 0


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "cli-model"
    assert main(["make-model", str(d), "--seed", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["make-model", str(d), "--seed", "3"]) == 0
    assert "already present" in capsys.readouterr().out
    assert main(["make-model", str(d), "--seed", "4"]) == 1
    assert "--force" in capsys.readouterr().err
    assert os.path.isdir(d)


# vLLM's own unpacking of an AWQ int32 (vllm/model_executor/layers/quantization/auto_awq.py,
# _REVERSE_AWQ_PACK_ORDER): output channel m of each eight sits in 4-bit slot REVERSE[m].
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    u = (packed.unsqueeze(-1) >> shifts) & 15
    return u[:, :, AWQ_REVERSE].reshape(packed.shape[0], -1)


def test_an_awq_checkpoint_unpacks_as_vllm_reads_it_to_the_dense_weight(tmp_path: Path) -> None:
    spec = spec_for("tiny", quant="awq")
    assert spec.dtype == "bfloat16" and spec.intermediate_size % 128 == 0
    d = tmp_path / "awq"
    make_model(d, spec)
    config = json.loads((d / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                      "version": "gemm", "modules_to_not_convert": None}
    dense = tmp_path / "dense"
    make_model(dense, replace(spec, quant="none"))  # the same model, its weights unquantized
    base = "model.layers.1.mlp.down_proj"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert f"{base}.weight" not in names and f"{base}.qweight" in names
        qweight, qzeros = f.get_tensor(f"{base}.qweight"), f.get_tensor(f"{base}.qzeros")
        scales = f.get_tensor(f"{base}.scales").float()
    with safe_open(str(dense / "model.safetensors"), "pt") as f:
        w = f.get_tensor(f"{base}.weight").float().t()
    k, n = _awq_unpack(qweight).shape
    assert (k, n) == (spec.intermediate_size, spec.hidden_size) and qweight.dtype == torch.int32
    q, z = _awq_unpack(qweight).float(), _awq_unpack(qzeros).float()
    deq = ((q.view(k // 128, 128, n) - z[:, None, :]) * scales[:, None, :]).reshape(k, n)
    # Rounding to the nearest of 16 levels: within half a step (and bf16's own rounding).
    step = scales.repeat_interleave(128, 0)
    assert ((deq - w).abs() <= step * 0.51 + w.abs() / 128).all()
    assert not ((deq - w).abs() <= step * 0.01).all()  # quantized, not a copy


@pytest.mark.parametrize("quant", ["awq", "fp8-ct"])
def test_a_quantized_weight_is_drawn_once_for_all_the_tensors_it_is_written_as(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str
) -> None:
    # AWQ writes each weight as qweight, qzeros and scales, FP8 as the weight and its scale:
    # making them from one draw is what keeps a 16 GiB AWQ model's making inside a GPU lease.
    drawn: list[str] = []
    draw = modelgen._draw

    def counting(name: str, shape: tuple[int, ...], spec: modelgen.ModelSpec) -> torch.Tensor:
        drawn.append(name)
        return draw(name, shape, spec)

    monkeypatch.setattr(modelgen, "_draw", counting)
    modelgen._awq.cache_clear()
    modelgen._quantized.cache_clear()
    make_model(tmp_path / quant, spec_for("tiny", quant=quant))
    assert "model.layers.1.mlp.down_proj.weight" in drawn
    assert len(drawn) == len(set(drawn)), sorted(n for n in drawn if drawn.count(n) > 1)


def test_awq_refuses_a_model_that_is_not_16_bit() -> None:
    with pytest.raises(ModelError, match="16-bit"):
        replace(spec_for("tiny", quant="awq"), dtype="float32").check()
