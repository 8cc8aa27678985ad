"""A model built twice (on the meta device, then for real) leaves vLLM's process-wide tables
as one build would: no duplicate layer names, no meta rotary tables, each MoE layer listed
once in the list that keys vLLM's torch.compile cache."""

from __future__ import annotations

from types import SimpleNamespace

from agent.engines.vllm.plugin.registry import forgetter


def _build(cfg: SimpleNamespace, rope: dict, names: list[str]) -> None:
    """What building a model does to vLLM's tables (attention and MoE layers, rotary
    embeddings): each layer registers by name, each MoE layer is appended to the list."""
    for n in names:
        cfg.static_forward_context[n] = object()
        cfg.static_all_moe_layers.append(n)
    rope[("rope", 64)] = object()


def test_what_the_meta_build_registered_is_taken_back():
    cfg = SimpleNamespace(static_forward_context={"kept": 1}, static_all_moe_layers=["kept"])
    rope: dict = {"cached": 2}
    forget = forgetter(cfg, rope)
    _build(cfg, rope, ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])
    forget()
    assert cfg.static_forward_context == {"kept": 1}
    assert rope == {"cached": 2}
    assert cfg.static_all_moe_layers == ["kept"]


def test_the_real_build_after_it_lists_each_moe_layer_once():
    cfg = SimpleNamespace(static_forward_context={}, static_all_moe_layers=[])
    rope: dict = {}
    names = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    forget = forgetter(cfg, rope)
    _build(cfg, rope, names)  # on the meta device
    forget()
    _build(cfg, rope, names)  # for real: vLLM would refuse a duplicate layer name
    # A first start over the holder hashes the same list as a warm start or a plain one,
    # so all three share one compiled graph.
    assert cfg.static_all_moe_layers == names
    assert list(cfg.static_forward_context) == names


def test_a_vllm_without_the_moe_list_or_the_rope_cache_is_served():
    cfg = SimpleNamespace(static_forward_context={})  # vLLM 0.25 has no static_all_moe_layers
    forget = forgetter(cfg, None)
    cfg.static_forward_context["model.layers.0.self_attn.attn"] = object()
    forget()
    assert cfg.static_forward_context == {}
