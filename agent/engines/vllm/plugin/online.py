"""Online quantization a warm start can restart: what the method set besides tensors.

vLLM 0.33's online methods (`--quantization fp8` on a bf16 checkpoint) quantize the weights
as they load and do not declare `supports_pre_processed_weights`, so vLLM's own weight
cache refuses them. For the ones listed here the post-processing is, from
vllm/model_executor/layers/quantization/online/fp8.py: the quantized weight and its scale
(tensors: held), the kernel's `process_weights_after_loading` (its scalar state: held in
the region's header, post.kernel_state; its padding: already in the held weight),
`layer.input_scale = None` (dynamic activation scales), and the layer's
`_already_called_process_weights_after_loading` flag, which makes the method skip a second
pass. A warm start sets those two attributes itself; any other online method (per-block,
per-channel, the MoE ones, which build their kernels in that pass) is held once
(support.ONCE_REGION) and gets no warm start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# By class name: a release that renames one drops it to the held-once path, never to a
# warm start it was not checked for.
ONLINE_RESTARTABLE = frozenset({"Fp8PerTensorOnlineLinearMethod"})

_DONE = "_already_called_process_weights_after_loading"


@contextlib.contextmanager
def online_done(model: Any) -> Iterator[list[str]]:
    """Around vLLM's `process_weights_after_loading` (under `weights_already_processed`) of
    a model whose tensors are already mapped from the held set: each layer of a method in
    ONLINE_RESTARTABLE gets the attributes its own pass would have left, and the method
    declares, for this call only, that it starts from its own output (it then returns at
    its flag, so nothing is transformed). Yields the layers' names."""
    marked: list[tuple[str, Any]] = []
    for name, layer in model.named_modules():
        qm = getattr(layer, "quant_method", None)
        if type(qm).__name__ not in ONLINE_RESTARTABLE:
            continue
        setattr(layer, _DONE, True)
        layer.input_scale = None
        # Marlin reads it on every call; it lives on the method, as for vLLM's fp8 checkpoints.
        if getattr(qm, "use_marlin", False) and hasattr(qm.fp8_linear, "marlin_input_dtype"):
            qm.fp8_linear.marlin_input_dtype = qm.marlin_input_dtype
        qm.supports_pre_processed_weights = True
        marked.append((name, qm))
    try:
        yield [name for name, _ in marked]
    finally:
        for _, qm in marked:
            del qm.supports_pre_processed_weights  # the class's own value again
