"""Engine adapters: one per engine kind, built by `build_adapter`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.engines.base import EngineAdapter, LaunchSpec

if TYPE_CHECKING:
    from agent.config import Config

__all__ = ["EngineAdapter", "LaunchSpec", "build_adapter"]


def build_adapter(config: Config) -> EngineAdapter:
    """The adapter for `config.engine.kind`."""
    kind = config.engine.kind
    if kind == "reference":
        from agent.engines.reference import ReferenceAdapter

        return ReferenceAdapter(config)
    if kind == "vllm":
        from agent.engines.vllm.adapter import VllmAdapter

        return VllmAdapter(config)
    raise ValueError(f"unknown engine kind {kind!r}")  # config validation makes this unreachable
