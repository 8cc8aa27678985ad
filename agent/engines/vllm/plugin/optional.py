"""vLLM internals the plugin uses where the running release has them, found by looking."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")


@contextlib.contextmanager
def already_processed(yes: bool) -> Iterator[None]:
    """vLLM's `weights_already_processed` (0.32+, made for its weight-cache IPC loader)
    around `process_weights_after_loading` when `yes`: its quant methods then skip every
    tensor transform and only rebuild their Python-side state, and one that cannot raises
    rather than transform held bytes a second time. Without it (an older vLLM), nothing."""
    if not yes:
        yield
        return
    try:
        from vllm.model_executor.utils import weights_already_processed
    except ImportError:
        yield
        return
    with weights_already_processed():
        yield


def trim_sleep_pool() -> int:
    """Give back the free blocks of vLLM's sleep-mode allocator (CuMemAllocator) in the pool
    it is loading the model into; the bytes released.

    torch's empty_cache cannot release a pluggable allocator's memory (pytorch issue
    145168), so vLLM trims the pool itself, but only once the whole load is over
    (`CuMemAllocator._trim`, 0.32+): until then what the model's parameters had is still
    the engine's while the holder allocates the held set. A vLLM without the method, or
    without the allocator in use, is left alone."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return 0
    alloc = getattr(CuMemAllocator, "instance", None)
    trim = getattr(alloc, "_trim", None)
    pools = getattr(alloc, "allocator_and_pools", None)
    usage = getattr(alloc, "get_current_usage", None)
    if alloc is None or trim is None or not isinstance(pools, dict) or usage is None:
        return 0
    before = usage()
    for entry in pools.get(getattr(alloc, "current_tag", None), []):
        trim(entry[0])
    freed = before - usage()
    if freed:
        log.info("pitstop loader: vLLM's sleep-mode pool gave back %.1f MB before the "
                 "weights were held", freed / 1e6)
    return freed
