"""The dtype casts a refill recipe may apply to a checkpoint tensor: float32 to bf16 or fp16."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from agent.errors import ModelError

# torch's bf16 NaN (c10::BFloat16's round_to_nearest_even).
BF16_NAN = 0x7FC0


class Cast(StrEnum):
    """What an engine did to a float32 checkpoint tensor as it loaded it (vLLM's `--dtype
    auto` runs a float32 model in bf16 or fp16)."""

    F32_BF16 = "f32-bf16"
    F32_F16 = "f32-f16"

    @property
    def ratio(self) -> int:
        """File bytes per region byte."""
        return 2

    def apply(self, data: bytes) -> bytes:
        """`data` (little-endian float32) cast as torch casts it: round to nearest even."""
        np = _numpy()
        if self is Cast.F32_F16:
            return np.frombuffer(data, dtype="<f4").astype("<f2").tobytes()
        u = np.frombuffer(data, dtype="<u4")
        out = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")
        out[(u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = BF16_NAN
        return out.tobytes()


def _numpy() -> Any:
    # Only a float32 checkpoint needs it (models ship in bf16): the agent of a vLLM node
    # installs without numpy, and a recipe that casts is then refused, not the agent.
    try:
        import numpy
    except ImportError:
        raise ModelError("casting a float32 checkpoint tensor needs numpy, which this "
                         "interpreter lacks; install Pitstop's reference extra, or serve "
                         "a checkpoint in the engine's dtype") from None
    return numpy
