"""How many workers a vLLM engine runs, read from its arguments, and what Pitstop does with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent import engineargs
from agent.engines.vllm.plugin.support import held_key
from agent.refusal import Refusal, RefusalCode

FLAGS: dict[str, tuple[str, ...]] = {
    "tensor": engineargs.TENSOR_PARALLEL,
    "pipeline": engineargs.PIPELINE_PARALLEL,
    "data": engineargs.DATA_PARALLEL,
}


@dataclass(frozen=True)
class Parallel:
    """An engine's tensor-, pipeline- and data-parallel sizes (1 each: one worker).

    Example::

        p = Parallel.of_args(["--max-model-len", "512", "-tp", "2"])
        p.tensor, p.workers       # (2, 2)
        p.held_keys("sha256-ab")  # ['sha256-ab+tp2.rank0', 'sha256-ab+tp2.rank1']
    """

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @classmethod
    def of_args(cls, args: Sequence[str]) -> Parallel:
        """The sizes `args` (engine.args) give vLLM; ConfigError for one that is not a
        positive whole number."""
        return cls(**{size: engineargs.workers(args, flags) for size, flags in FLAGS.items()})

    @property
    def workers(self) -> int:
        return self.tensor * self.pipeline * self.data

    def held_keys(self, digest: str) -> list[str]:
        """What the holder keeps each tensor-parallel rank's weights under, rank 0 first."""
        return [held_key(digest, self.tensor, r) for r in range(self.tensor)]

    def unsupported(self) -> Refusal | None:
        """Why Pitstop's plugin cannot hold this engine's weights: pipeline or data
        parallelism (a held set per tensor-parallel rank is all it keeps); None otherwise."""
        if self.pipeline == 1 and self.data == 1:
            return None
        return Refusal(
            RefusalCode.PARALLEL_UNSUPPORTED,
            f"vLLM runs pipeline-parallel size {self.pipeline} and data-parallel "
            f"size {self.data}: Pitstop holds weights and takes images of tensor-parallel "
            "workers only; the engine starts cold",
        )

    def held_refusal(self, cuda: bool) -> Refusal | None:
        """Why Pitstop's plugin holds none of this engine's weights: pipeline or data
        parallelism, or tensor-parallel workers on CUDA (each rank's set belongs in its own
        GPU's holder; the agent talks to the holder of the engine's first GPU only)."""
        unsupported = self.unsupported()
        if unsupported is not None or self.tensor == 1 or not cuda:
            return unsupported
        return Refusal(
            RefusalCode.TENSOR_PARALLEL,
            f"vLLM runs {self.tensor} tensor-parallel workers on CUDA: holding each "
            "rank's weights in its own GPU's holder is not built yet, so the engine loads "
            "them from disk",
        )

    def image_refusal(self, cuda: bool) -> Refusal | None:
        """Why no image of this engine's tree is taken or restored; None for one worker,
        and for tensor-parallel workers on CPU (each detaches and attaches its own set)."""
        unsupported = self.unsupported()
        if unsupported is not None:
            return unsupported
        if self.tensor == 1 or not cuda:
            return None
        return Refusal(
            RefusalCode.TENSOR_PARALLEL,
            f"vLLM runs {self.tensor} tensor-parallel workers on CUDA: a checkpoint of "
            "processes on several GPUs needs NVIDIA driver 590 or later and is not "
            "attempted (docs/vllm.md, Tensor parallel)",
        )

    def one_worker_refusal(self, rung: str) -> Refusal | None:
        """Why rung `rung`, which serves engines of one worker only (refill, standby),
        skips this one; None for one worker."""
        if self.workers == 1:
            return None
        return Refusal(
            RefusalCode.TENSOR_PARALLEL,
            f"vLLM runs {self.workers} workers: the {rung} rung serves engines of one "
            "worker (docs/vllm.md, Tensor parallel)",
        )
