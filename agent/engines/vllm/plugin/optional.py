"""vLLM internals the plugin uses where the running release has them, found by looking."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


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
