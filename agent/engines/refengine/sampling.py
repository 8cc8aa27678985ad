"""Turn logits into the next token: greedy, or seeded sampling with temperature, top-k, top-p."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # like vLLM: a temperature this small means greedy


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings, already validated."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or less: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class Sampler:
    """Per-request sampler; its own torch.Generator makes a seeded request reproducible
    whatever else the engine is serving at the same time.

    Example::

        s = Sampler(SamplingParams(max_tokens=8, temperature=0.7, seed=1))
        token = s.sample(logits)
    """

    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: float32 CPU tensor of shape (vocab,)."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))  # ties go to the lowest id: deterministic
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_k > 0 or p.top_p < 1.0:
            probs, order = torch.sort(probs, descending=True)
            if p.top_k > 0:
                probs[p.top_k:] = 0.0
            if p.top_p < 1.0:
                # keep the smallest prefix whose mass reaches top_p (the first token always)
                before = torch.cumsum(probs, dim=-1) - probs
                probs[before >= p.top_p] = 0.0
            pick = torch.multinomial(probs, 1, generator=self.generator)
            return int(order[pick])
        return int(torch.multinomial(probs, 1, generator=self.generator))
