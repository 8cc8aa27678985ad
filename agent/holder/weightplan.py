"""Which held regions a model's safetensors files become, and the refill plan that records them."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.errors import ModelError
from agent.fsutil import read_owned, write_private
from agent.holder.casts import Cast
from agent.weights import FileDigest, WeightsDigester, is_model_file, manifest_digest, stat_key

# Where a tenant-independent description of the held weights lives: the holder's own
# directory (<dir>/<gpu>/), so a holder that starts after a reboot finds it with no agent.
PLAN_NAME = "refill.json"
PLAN_VERSION = 1
# safetensors dtype names the holder path maps (torch attribute names for the tenant).
# FP8 checkpoints (vLLM's fp8 and compressed-tensors formats) store their linear weights
# as F8_E4M3; E5M2 is the other FP8 type safetensors names.
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}
# A safetensors header is a few KB to a few MB; a length past this is not one.
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class WeightFile:
    """One safetensors file: where its data section starts and what tensors it holds."""

    path: Path
    data_offset: int
    data_size: int
    tensors: dict[str, TensorEntry]

    @classmethod
    def read_header(cls, path: Path) -> WeightFile:
        """Only the header (an 8-byte little-endian length, then JSON): the tensors' bytes
        stay on disk."""
        try:
            with path.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > MAX_HEADER:
                    raise ValueError(f"a header of {n} bytes")
                header = json.loads(f.read(n))
                size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError, struct.error) as e:
            raise ModelError(f"{path}: not a readable safetensors file: {e}") from e
        tensors = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in DTYPES:
                raise ModelError(f"{path}: tensor {name} has dtype {meta['dtype']}, which the "
                                 "holder path does not map")
            begin, end = meta["data_offsets"]
            tensors[name] = TensorEntry(meta["dtype"], tuple(meta["shape"]), begin, end)
        return cls(path=path, data_offset=8 + n, data_size=size - 8 - n, tensors=tensors)


def region_name(digest: str, path: Path) -> str:
    """The digest leads every name, so weights of another content never share a region."""
    return f"{digest}/{path.name}"


def content_addressed(name: str, digest: str) -> bool:
    """Whether a region's bytes are fixed by its digest: a weights region (`region_name`).

    Such a region may be loaded again, by a tenant or by the holder's refill, and is still
    the same bytes: a restored engine re-attaches it by digest even though the holder or
    the epoch changed. A KV pool's regions are named otherwise and never are.
    """
    return name.startswith(f"{digest}/")


@dataclass(frozen=True)
class WeightRegion:
    """One held region of a model: the data section of one safetensors file."""

    name: str
    path: Path
    offset: int  # where its bytes start in the file
    size: int


def weight_regions(digest: str, files: list[WeightFile]) -> list[WeightRegion]:
    """The held regions of a model, sorted by name: what `HeldWeights` creates and what the
    holder's refill loads, so both give byte-identical regions under the same names."""
    out = [WeightRegion(region_name(digest, f.path), f.path, f.data_offset, f.data_size)
           for f in files if f.data_size > 0]
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ModelError(f"two weight files share a name among {sorted(f.path for f in files)}; "
                         "held regions are named by file name")
    return sorted(out, key=lambda r: r.name)


def is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanFile(_Model):
    """A file of the model directory as it was when its digest was taken."""

    name: str
    size: int
    sha256: str
    # (size, mtime_ns, ctime_ns, inode, device): the key the agent's digest cache trusts.
    key: list[int]


class PlanPart(_Model):
    """Bytes of a model file copied into a region: `size` bytes of `file` from `at`, to the
    region's `offset`; with `cast`, `size` region bytes cast from `cast.ratio` times as many
    bytes of the file (a float32 tensor the engine holds in bf16 or fp16)."""

    file: str
    at: int = Field(ge=0)
    offset: int = Field(ge=0)
    size: int = Field(gt=0)
    cast: Cast | None = None

    @property
    def file_size(self) -> int:
        return self.size * self.cast.ratio if self.cast is not None else self.size


class PlanRegion(_Model):
    """One region of a plan: `size` bytes of `file` from `offset`; or, in a recipe, the
    `parts` copied from the model's files with zeros everywhere else, which rebuild a region
    whose bytes hash to `sha256`."""

    name: str
    file: str
    offset: int
    size: int
    parts: tuple[PlanPart, ...] | None = None
    sha256: str | None = None

    def copies(self) -> list[PlanPart]:
        """What is copied into the region, in region order."""
        if self.parts is None:
            return [PlanPart(file=self.file, at=self.offset, offset=0, size=self.size)]
        return sorted(self.parts, key=lambda c: c.offset)

    def zeros(self) -> list[tuple[int, int]]:
        """The (offset, length) spans of the region no copy writes: zeros."""
        out, at = [], 0
        for c in self.copies():
            if c.offset > at:
                out.append((at, c.offset - at))
            at = max(at, c.offset + c.size)
        if at < self.size:
            out.append((at, self.size - at))
        return out

    def files(self) -> set[str]:
        return {c.file for c in self.copies()}


class PlanSource(StrEnum):
    """Where a plan's bytes come from."""

    # The data sections of the model's safetensors files: an engine that holds the files'
    # bytes as they are (the reference engine).
    FILES = "files"
    # Copies of held regions, written from the holder's memory once an engine committed
    # them (agent/holder/heldcopy.py): an engine that holds its own layout (vLLM's
    # parameters). The region name fixes the bytes (weights digest, vLLM version, names,
    # dtypes and shapes), as it does for the warm start that attaches them by name.
    COPY = "copy"
    # The model's safetensors files, each region rebuilt from the parts a recipe names
    # (agent/holder/recipe.py): an engine that holds its own layout of the files' bytes,
    # on a node that never held them (a pulled hybrid snapshot carries the recipe).
    RECIPE = "recipe"


class RefillPlan(_Model):
    """What the holder needs to load a model's weights by itself: files, digest, regions.

    Example::

        plan = build_plan(model_dir, digester.digest(model_dir))
        write_plan(holder_dir, plan)         # <dir>/<gpu>/refill.json
        load_plan(holder_dir).drift()        # None while the files are unchanged
    """

    version: int = PLAN_VERSION
    digest: str
    # The directory the files are in: the model's, or the copies' (source copy).
    model: str
    files: list[PlanFile]
    regions: list[PlanRegion]
    source: PlanSource = PlanSource.FILES

    @property
    def bytes(self) -> int:
        return sum(r.size for r in self.regions)

    def drift(self) -> Drift | None:
        """Why the files on disk are no longer the ones this plan describes, or None."""
        if self.source is PlanSource.COPY:
            return self._copy_drift()
        drift = self._files_drift()
        if drift is not None or self.source is PlanSource.RECIPE:
            return drift or self._recipe_drift()
        model = Path(self.model)
        try:
            files = [WeightFile.read_header(model / f.name) for f in self.files
                     if is_weight_file(f.name)]
            want = [PlanRegion(name=r.name, file=r.path.name, offset=r.offset, size=r.size)
                    for r in weight_regions(self.digest, files)]
        except ModelError as e:
            return Drift(DriftCode.CHANGED, "", str(e))
        if want != self.regions:
            return Drift(DriftCode.INCONSISTENT, "", "the plan's regions are not the ones its "
                         "files make")
        return None

    def _files_drift(self) -> Drift | None:
        """Why the model's files are not the ones the plan recorded, or None."""
        if manifest_digest(tuple(FileDigest(f.name, f.size, f.sha256)
                                 for f in self.files)) != self.digest:
            return Drift(DriftCode.INCONSISTENT, "", "the plan's files do not make its digest")
        model = Path(self.model)
        try:
            now = sorted(n for n in os.listdir(model) if is_model_file(n))
        except OSError as e:
            return Drift(DriftCode.MISSING, self.model, f"cannot list it: {e.strerror}")
        names = sorted(f.name for f in self.files)
        if now != names:
            added, gone = sorted(set(now) - set(names)), sorted(set(names) - set(now))
            return Drift(DriftCode.FILES, self.model,
                         "files " + ", ".join([*(f"added {n}" for n in added),
                                               *(f"removed {n}" for n in gone)]))
        for f in self.files:
            try:
                key = stat_key(os.stat(model / f.name))
            except OSError as e:
                return Drift(DriftCode.MISSING, f.name, f"cannot stat it: {e.strerror}")
            if key != f.key:
                return Drift(DriftCode.CHANGED, f.name, _key_change(f.key, key))
        return None

    def _recipe_drift(self) -> Drift | None:
        # Each part inside its file and its region, none overlapping another: a recipe of
        # these files, whatever else it says (its bytes were checked when it was made).
        sizes = {f.name: f.size for f in self.files if is_weight_file(f.name)}
        for r in self.regions:
            end = 0
            for c in r.copies():
                if c.file not in sizes or c.at + c.file_size > sizes[c.file] \
                        or c.offset < end or c.offset + c.size > r.size:
                    return Drift(DriftCode.INCONSISTENT, r.name, f"a part ({c.file} at {c.at}, "
                                 f"{c.size} bytes to {c.offset}) is outside its file or "
                                 "region, or overlaps another")
                end = c.offset + c.size
            if r.parts is None or not content_addressed(r.name, self.digest):
                return Drift(DriftCode.INCONSISTENT, r.name, "not a recipe's region")
        return None

    def _copy_drift(self) -> Drift | None:
        # The model's own files are the agent's digest's to check (plan.digest against it);
        # the copies only have to be the files that were written.
        names = {f.name for f in self.files}
        if any(r.file not in names or not content_addressed(r.name, self.digest)
               for r in self.regions):
            return Drift(DriftCode.INCONSISTENT, "", "the plan's regions are not its copies")
        for f in self.files:
            try:
                key = stat_key(os.stat(Path(self.model) / f.name))
            except OSError as e:
                return Drift(DriftCode.MISSING, f.name, f"cannot stat it: {e.strerror}")
            if key != f.key:
                return Drift(DriftCode.CHANGED, f.name, _key_change(f.key, key))
        return None


def _key_change(was: list[int], now: list[int]) -> str:
    fields = ("size", "mtime_ns", "ctime_ns", "inode", "device")
    return "changed since the plan was made (" + ", ".join(
        f"{k} {a} -> {b}" for k, a, b in zip(fields, was, now, strict=True) if a != b) + ")"


class DriftCode(StrEnum):
    """Why a refill plan no longer describes the files on disk."""

    CHANGED = "changed"            # a file's size, times, inode or header differ
    FILES = "files"                # files were added to or removed from the model directory
    MISSING = "missing"            # a file or the directory cannot be read
    INCONSISTENT = "inconsistent"  # the plan contradicts itself (hand-edited, another version)


@dataclass(frozen=True)
class Drift:
    code: DriftCode
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}" if self.where else self.detail


def _keys(model: Path, names: list[str]) -> dict[str, list[int]]:
    return {n: stat_key(os.stat(model / n)) for n in names}


def plan_for(model: Path, digester: WeightsDigester, expected: str) -> RefillPlan:
    """The plan for `model`, whose digest must still be `expected` (the one the held regions
    are named by). Every file's stat key is read before and after the digest: equal, no
    file was written in between, so each key belongs to the bytes its sha256 was taken of
    (a write always moves ctime). ModelError otherwise: try again later."""
    model = Path(model)
    names = digester.list_files(model)
    before = _keys(model, names)
    d = digester.digest(model)
    if _keys(model, names) != before or [f.name for f in d.files] != names:
        raise ModelError(f"{model} changed while its refill plan was made; try again")
    if d.digest != expected:
        raise ModelError(f"{model} now has weights {d.digest}, not the {expected} held")
    return build_plan(model, d.files, d.digest, before)


def build_plan(model: Path, files: tuple[FileDigest, ...], digest: str,
               keys: dict[str, list[int]] | None = None) -> RefillPlan:
    """The plan for `model` whose digest (`files`, `digest`) was taken while its files had
    `keys` (read now when None: then the caller vouches that nothing changed since)."""
    model = Path(model)
    keys = keys if keys is not None else _keys(model, [f.name for f in files])
    out, weights = [], []
    for f in files:
        if keys[f.name][0] != f.size:
            raise ModelError(f"{model / f.name} changed since it was digested; try again")
        out.append(PlanFile(name=f.name, size=f.size, sha256=f.sha256, key=keys[f.name]))
        if is_weight_file(f.name):
            weights.append(WeightFile.read_header(model / f.name))
    regions = [PlanRegion(name=r.name, file=r.path.name, offset=r.offset, size=r.size)
               for r in weight_regions(digest, weights)]
    if not regions:
        raise ModelError(f"{model} has no safetensors weights the holder could load")
    return RefillPlan(digest=digest, model=str(model), files=out, regions=regions)


def write_plan(directory: Path, plan: RefillPlan) -> Path:
    path = Path(directory) / PLAN_NAME
    # A plan of the files' bytes is written as before the copies existed: a holder of the
    # previous version, still running through an upgrade of the agent, reads it.
    exclude = {"source"} if plan.source is PlanSource.FILES else None
    write_private(path, plan.model_dump_json(indent=1, exclude=exclude,
                                             exclude_none=True).encode())
    return path


def load_plan(directory: Path) -> RefillPlan | None:
    """The plan in `directory`, or None when there is none; ModelError when unreadable."""
    path = Path(directory) / PLAN_NAME
    data = read_owned(path, "the refill plan")
    if data is None:
        return None
    try:
        plan = RefillPlan.model_validate_json(data)
    except ValidationError as e:
        raise ModelError(f"{path}: not a refill plan this holder reads ({e.errors()[0]['msg']});"
                         " remove it (the agent writes a new one)") from None
    if plan.version != PLAN_VERSION:
        raise ModelError(f"{path}: plan version {plan.version}, this holder reads "
                         f"{PLAN_VERSION}; remove it")
    return plan


__all__ = ["DTYPES", "Drift", "DriftCode", "PlanFile", "PlanPart", "PlanRegion", "PlanSource",
           "RefillPlan", "TensorEntry", "WeightFile", "WeightRegion", "build_plan",
           "content_addressed", "load_plan", "plan_for", "region_name", "weight_regions",
           "write_plan"]
