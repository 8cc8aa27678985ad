"""The snapshot manifest: a typed, versioned record of what an image is and depends on."""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent.identity import Identity

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# What every image file looked like (inode, size, mtime, ctime) when it was hashed at seal.
SEALED_NAME = "sealed.json"
# Present while a snapshot is still being made under its final name (a backend whose image
# cannot move after it was made: vLLM records its artifact's path in the dumped tree). Its
# removal is that snapshot's publication.
DRAFT_NAME = ".draft"
# Snapshot ids become directory names: no separators, no leading dot (dot names are
# the store's own temp and quarantine entries).
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

# full and hybrid: Pitstop's CRIU (+ CUDA) images; vllm: an artifact `vllm snapshot create`
# made (its files under vllm/), restored by `vllm snapshot restore`.
SnapshotKind = Literal["full", "hybrid", "vllm"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def check_image_name(v: str) -> str:
    """A path relative to the snapshot directory, no way out of it, not the store's own files."""
    parts = v.split("/")
    if v.startswith("/") or any(p in ("", ".", "..") for p in parts) or \
            v in (MANIFEST_NAME, SEALED_NAME, DRAFT_NAME):
        raise ValueError(f"image file name {v!r} must be a relative path inside the snapshot "
                         "directory")
    return v


class ImageFile(_Strict):
    """One file of the image, relative to the snapshot directory (a backend may keep its files
    in subdirectories: vllm/images/pages-1.img), with the sha256 of each of its
    `Manifest.chunk_bytes`-sized pieces (hashed in parallel; the last may be short)."""

    name: str
    size: int = Field(ge=0)
    sha256_chunks: tuple[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")], ...] = Field(
        min_length=1
    )

    @field_validator("name")
    @classmethod
    def _inside(cls, v: str) -> str:
        return check_image_name(v)


class ProcessTree(_Strict):
    """The dumped process tree: its root and every PID CRIU will recreate."""

    root_pid: int = Field(gt=0)
    pids: tuple[int, ...]
    # fd number -> "pipe:[INODE]" for the root's stdout/stderr when they were pipes to
    # the agent; restore re-wires each with `criu --inherit-fd` to a new pipe.
    inherited_pipes: dict[str, str] = Field(default_factory=dict)
    # The PIDs that held a CUDA context (vLLM's engine core is a child, not the root);
    # each was CUDA-checkpointed before the dump and is CUDA-restored after a restore.
    cuda_pids: tuple[int, ...] = ()
    # Files of /dev/shm the tree mapped or held (vLLM's shared-memory ring buffer and
    # semaphores, CRIU's link_remap.N of unlinked ones), saved in the image as
    # "outside.<name>" at the dump and put back before every restore.
    shm_files: tuple[str, ...] = ()
    # Paths the tree's Unix sockets bind (vLLM's ZeroMQ ipc sockets in /tmp): a stale
    # socket file left there by the dead tree is removed before a restore.
    socket_paths: tuple[str, ...] = ()


class CanaryMethod(StrEnum):
    """How a canary answer was produced. An answer is only compared with one produced the
    same way: in bf16 a prompt prefilled in one pass and one fed a token at a time may pick
    different greedy tokens, and such a difference is not a wrong engine."""

    # The engine's own way with a plain request (the reference engine: one prompt token a
    # forward call, unless --prefill-chunk says more). Records made before the method was
    # recorded were made this way, so it is what a record without one means.
    ENGINE_DEFAULT = "engine_default"
    # The whole prompt in one forward call, then one decode step a token (replayed from CUDA
    # graphs on a GPU): what a real request costs, one read of the weights a token.
    ONE_PASS_PREFILL = "one_pass_prefill"
    # The model's top prediction at every prompt position (the prompt's logprobs, vLLM's
    # `prompt_logprobs`) and one generated token, all from one forward pass: as many greedy
    # picks as a long answer for one read of the weights instead of one a token.
    PROMPT_PREDICTIONS = "prompt_predictions"


class Canary(_Strict):
    """The fixed request and the answer the engine gave just before the dump."""

    prompt: str
    max_tokens: int = Field(ge=1)
    text: str
    token_ids: tuple[int, ...]
    method: CanaryMethod = CanaryMethod.ENGINE_DEFAULT


class Manifest(_Strict):
    """Everything about one published snapshot.

    Example::

        m = Manifest.model_validate_json(path.read_bytes())
        m.identity.kernel, m.kind, m.image_bytes
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    id: str = Field(pattern=ID_PATTERN.pattern)
    kind: SnapshotKind
    created_at: datetime
    identity: Identity
    process: ProcessTree
    chunk_bytes: int = Field(gt=0)
    files: tuple[ImageFile, ...]
    # stage name ("cuda_lock", "cuda_checkpoint", "criu_dump", "checksum", ...) -> seconds
    timings: dict[str, float]
    canary: Canary
    criu_flags: tuple[str, ...] = ()
    # A hybrid image's held regions at dump time (name -> holder_id, epoch, digest,
    # chunks): a restore is tried only while the holder still has exactly these.
    held: dict[str, dict[str, Any]] | None = None
    # A hybrid image's refill recipe (agent/holder/weightplan.py RefillPlan, source recipe):
    # how a holder rebuilds `held` from the model files, on a node that never held them.
    refill: dict[str, Any] | None = None
    # Files the backend rewrites at every restore (vLLM's release marker, restore log and
    # the engine's log): neither sealed nor verified, and allowed to come and go.
    scratch: tuple[str, ...] = ()

    @field_validator("scratch")
    @classmethod
    def _scratch_inside(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            check_image_name(name)
        return v

    @property
    def image_bytes(self) -> int:
        return sum(f.size for f in self.files)
