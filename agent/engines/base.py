"""What the supervisor needs to know about an engine kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agent.config import Config
    from agent.engines.probe import EngineProbe
    from agent.refusal import Refusal
    from agent.store.manifest import CanaryMethod


@dataclass(frozen=True)
class Detached:
    """What an engine dropped before a snapshot (`EngineAdapter.detach`): bytes freed, and
    the held regions it had mapped (name -> holder_id, epoch, digest, chunks; None when it
    maps none): a snapshot with held regions is a hybrid one, and records what a restore
    must find held."""

    freed_bytes: int = 0
    held: dict[str, dict[str, object]] | None = None


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one engine process: argv, extra environment, where its socket will be."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    socket: Path | None = None
    # Start it under a small root process that stays (agent/deathsig.py `--root`).
    small_root: bool = False


class EngineAdapter(Protocol):
    """One engine kind, as the supervisor drives it.

    Example::

        adapter = build_adapter(config)
        spec = adapter.launch_spec()
        # the supervisor starts spec.argv, then polls adapter.health_path on spec.socket
    """

    kind: str
    health_path: str
    # The engine's own Prometheus exposition on its socket, or None when it has none; the front
    # passes GET of this path through to the engine (docs/vllm.md, "Metrics").
    metrics_path: str | None
    # A piece of an error answer (status >= 500) that means the engine itself is dead, not
    # just this request: the front then holds the request for the next engine instead of
    # passing the error on. None when the engine has no such answer (it just goes away).
    dead_marker: bytes | None
    # How this engine's new canary records are made; a record made another way (an older
    # Pitstop's) is checked the way it was made (canary_fields), then made again this way.
    canary_method: CanaryMethod
    # The longest its detach, or its resume, may take in all (the control calls around a
    # snapshot and after a restore); past it the engine is stuck.
    control_limit_s: float

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded configuration of the same engine kind."""
        ...

    def launch_spec(self) -> LaunchSpec:
        """The command line and environment of a cold start."""
        ...

    def version(self) -> str:
        """The engine's version, for identities and the build-info metric."""
        ...

    def model_name(self) -> str:
        """The name clients use in the `model` field."""
        ...

    def canary_fields(self, method: CanaryMethod) -> dict[str, Any]:
        """What the canary request adds to its body to be answered by `method`."""
        ...

    def exit_is_failure(self, returncode: int) -> bool:
        """Whether an exit the agent did not ask for counts as a crash (always, so far)."""
        ...

    def kv_claimed_in_holder(self) -> bool:
        """Whether the engine keeps its KV pool in the holder, where one process at a time
        may claim it: a standby then cannot have it until the dead engine is gone."""
        ...

    def holder_refusal(self) -> Refusal | None:
        """Why this engine cannot keep its weights in the holder here; None when it can."""
        ...

    def warm_refusal(self, regions: list[str]) -> Refusal | None:
        """Why a fresh engine must not attach the committed held regions named `regions`
        (the warm rung); None when it may."""
        ...

    def held_keys(self, digest: str) -> list[str]:
        """What the holder keeps this engine's weights of `digest` under: one key for an
        engine of one worker, one per tensor-parallel rank (each holds its own shard)."""
        ...

    def image_refusal(self) -> Refusal | None:
        """Why no image of this engine's tree is taken or restored here (it runs several
        workers where that is not done); None when images serve it. Asked on the event
        loop too: it must not block (what it reads once, the rungs read first off it)."""
        ...

    def one_worker_refusal(self, rung: str) -> Refusal | None:
        """Why `rung`, which serves engines of one worker only (refill, standby), skips
        this one; None when it runs one worker."""
        ...

    def holder_args(self, socket: Path, digest: str) -> list[str]:
        """The engine's flags that make it map the weights of `digest` from the holder."""
        ...

    async def detach(self, probe: EngineProbe) -> Detached | None:
        """Before a snapshot: drop what the image need not hold (the KV pool, the held
        weights' mapping; the engine's POST /pitstop/prepare); None when the engine has
        nothing to drop. Not a rung's `prepare`, which chooses what a start uses."""
        ...

    async def resume(self, probe: EngineProbe) -> None:
        """After a dump or a restore: rebuild what detach dropped; EngineError if it cannot."""
        ...
