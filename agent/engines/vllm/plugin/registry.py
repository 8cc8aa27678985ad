"""What a model build registers in vLLM's process-wide tables, taken back for a model built
twice (on the meta device, then for real)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, MutableSequence
from typing import Any


def forgetter(compilation_config: Any, rope_cache: MutableMapping[Any, Any] | None,
              ) -> Callable[[], None]:
    """What takes back, after the meta build, what it registered.

    Each attention and MoE layer registers itself by name as it is built (vLLM refuses a
    duplicate layer name), vLLM caches rotary embeddings (the real model would get the meta
    one's tables, which have no data), and each MoE layer appends its name to
    `static_all_moe_layers` (vLLM 0.32+). That list is one of the factors of vLLM's
    torch.compile cache key: left with every MoE layer twice, a first start over the holder
    compiles under a key no other start of the model has, and the warm start after it
    compiles again (24 s of a 101 s warm start of an 8 GiB MoE on an H200)."""
    tables: list[MutableMapping[Any, Any]] = [compilation_config.static_forward_context]
    if rope_cache is not None:
        tables.append(rope_cache)
    had = [set(t) for t in tables]
    moe: MutableSequence[Any] = getattr(compilation_config, "static_all_moe_layers", [])
    moe_before = len(moe)

    def forget() -> None:
        for t, keys in zip(tables, had, strict=True):
            for k in set(t) - keys:
                del t[k]
        del moe[moe_before:]
    return forget
