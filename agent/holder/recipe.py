"""A refill recipe: each held region rebuilt from the model files' bytes, checked before it is kept.

vLLM holds its parameters, not the files' bytes: fused (qkv_proj from q/k/v_proj,
gate_up_proj from gate/up_proj), padded (the vocabulary), laid out back to back. The
engine that laid a region out leaves where each parameter lies (agent/holder/paramlayout.py);
from that, each checkpoint tensor's bytes are looked for in the one parameter they can have
gone to (its own name, else a parameter of the same module path and kind, which is where a
fused parameter's pieces go; as the file has them, or a float32 tensor cast to bf16 or fp16
as torch casts it), and the region becomes a list of parts copied from the files,
zeros elsewhere. A recipe is kept only when rebuilding each region from it gives the very
bytes held (their sha256): a model whose loader transformed a tensor otherwise on its way
in (a permutation, a rename to another module path) gets none, and says which tensors were
not found.

Run as its own process (`python -m agent.holder.recipe`), a tenant of the holder that
attaches the set read-only, as agent/holder/heldcopy.py does; it prints the recipe's
regions as JSON, or why there is none.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.errors import HolderError, ModelError
from agent.holder.casts import Cast
from agent.holder.client import HolderClient
from agent.holder.heldcopy import MemfdReader, RegionReader, reader_for
from agent.holder.paramlayout import ParamLayout, ParamSlot, read_layout
from agent.holder.protocol import MemoryKind, RegionInfo
from agent.holder.weightplan import PlanPart, PlanRegion, WeightFile, is_weight_file
from agent.refusal import Refusal, RefusalCode

PIECE = 16 << 20


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor's bytes: `size` of `file` from `at` (from the file's start)."""

    name: str
    file: str
    at: int
    size: int
    dtype: str = "U8"


def checkpoint_tensors(model: Path) -> list[Tensor]:
    """Every non-empty tensor of the model's safetensors files, from their headers."""
    out = []
    for name in sorted(os.listdir(model)):
        if not is_weight_file(name):
            continue
        wf = WeightFile.read_header(model / name)
        out += [Tensor(t, name, wf.data_offset + e.begin, e.end - e.begin, e.dtype)
                for t, e in wf.tensors.items() if e.end > e.begin]
    return out


def _kin(name: str) -> tuple[str, str]:
    """(module path, kind): `a.b.q_proj.weight` -> (`a.b`, `weight`)."""
    head, _, leaf = name.rpartition(".")
    return head.rpartition(".")[0], leaf


def candidates(slots: Iterable[ParamSlot], tensors: Iterable[Tensor]) -> dict[str, list[Tensor]]:
    """For each parameter, the checkpoint tensors whose bytes may be in it: the one of its
    own name, or those of its module path and kind that no parameter is named after (the
    pieces of a fused parameter)."""
    names = {s.name for s in slots}
    siblings: dict[tuple[str, str], list[str]] = {}
    for n in sorted(names):
        siblings.setdefault(_kin(n), []).append(n)
    out: dict[str, list[Tensor]] = {n: [] for n in names}
    for t in tensors:
        for n in [t.name] if t.name in names else siblings.get(_kin(t.name), []):
            out[n].append(t)
    return out


def _free(at: int, n: int, taken: list[tuple[int, int]]) -> bool:
    return not any(at < e and b < at + n for b, e in taken)


def _find(hay: bytes | bytearray, needle: bytes, taken: list[tuple[int, int]]) -> int:
    """The first place of `needle` in `hay` that overlaps nothing `taken`; -1 if none (two
    equal tensors, such as two zero biases, go to two places).

    Where the engine put it is nearly always known: at the start, or right after the piece
    placed last (q, k, v and gate, up are fused in that order). That place is compared
    first (memcmp), and searched for only when it holds other bytes: a search preprocesses
    the needle and scans the parameter, about ten times slower for a 100 MB piece."""
    n = len(needle)
    guess = taken[-1][1] if taken else 0
    if guess + n <= len(hay) and _free(guess, n, taken) and hay.startswith(needle, guess):
        return guess
    at = hay.find(needle)
    while at >= 0 and not _free(at, n, taken):
        at = hay.find(needle, at + 1)
    return at


def place(slot: ParamSlot, data: bytes | bytearray, tensors: list[Tensor], model: Path,
          placed: set[str]) -> list[PlanPart]:
    """The parts that copy checkpoint tensors into `slot`, whose bytes are `data`."""
    parts, taken = [], []
    # The biggest first: a few bytes are found anywhere, and must not take the place of a
    # tensor whose bytes are found only where they are.
    free = len(data)
    for t in sorted(tensors, key=lambda t: (t.name != slot.name, -t.size, t.name)):
        # A piece of another parameter of the module (o_proj's slot is tried for q/k/v_proj
        # too) fits no more once the slot is full: not read, not searched for. (A float32
        # tensor may be held cast to half its size.)
        if t.name in placed or (t.size // 2 if t.dtype == "F32" else t.size) > free:
            continue
        with (model / t.file).open("rb") as f:
            raw = os.pread(f.fileno(), t.size, t.at)
        # As the file has it; else as the engine may have cast it on its way in.
        casts: list[Cast | None] = [None, *(Cast if t.dtype == "F32" else ())]
        for cast in casts:
            needle = cast.apply(raw) if cast is not None else raw
            at = _find(data, needle, taken) if len(needle) <= len(data) else -1
            if at >= 0:
                taken.append((at, at + len(needle)))
                free -= len(needle)
                placed.add(t.name)
                parts.append(PlanPart(file=t.file, at=t.at, offset=slot.offset + at,
                                      size=len(needle), cast=cast))
                break
    return parts


class _Stream:
    """A region's bytes read front to back, every byte hashed on the way."""

    def __init__(self, pieces: Iterator[memoryview]) -> None:
        self._pieces = pieces
        self._left = memoryview(b"")
        self.sha256 = hashlib.sha256()
        self.at = 0

    def take(self, n: int) -> bytearray:
        out = bytearray(n)
        got = 0
        while got < n:
            if not self._left:
                self._left = next(self._pieces)
            k = min(n - got, len(self._left))
            out[got:got + k] = self._left[:k]
            got += k
            self._left = self._left[k:]
        self.sha256.update(out)
        self.at += n
        return out

    def skip_to(self, offset: int) -> None:
        while self.at < offset:
            self.take(min(PIECE, offset - self.at))


def rebuild_sha256(region: PlanRegion, model: Path) -> str:
    """The sha256 of the bytes `region`'s recipe makes from the files in `model`."""
    h = hashlib.sha256()
    at = 0
    zeros = bytes(min(PIECE, region.size))
    spans = [(c.offset, c) for c in region.copies()] + [(o, n) for o, n in region.zeros()]
    for offset, what in sorted(spans, key=lambda s: s[0]):
        assert offset == at, "a recipe's parts and zeros tile the region"
        if isinstance(what, int):
            for k in range(0, what, len(zeros)):
                h.update(zeros[:min(len(zeros), what - k)])
            at += what
            continue
        with (model / what.file).open("rb") as f:
            for k in range(0, what.file_size, PIECE):
                raw = os.pread(f.fileno(), min(PIECE, what.file_size - k), what.at + k)
                h.update(what.cast.apply(raw) if what.cast is not None else raw)
        at += what.size
    return h.hexdigest()


def check(region: PlanRegion, model: Path) -> Refusal | None:
    """Why `region`'s recipe does not rebuild the bytes it recorded (their sha256), or None."""
    if region.parts is None or region.sha256 is None:
        return Refusal(RefusalCode.NO_REFILL_RECIPE, f"{region.name}: not a recipe's region")
    got = rebuild_sha256(region, model)
    if got != region.sha256:
        return Refusal(RefusalCode.NO_REFILL_RECIPE, (
            f"{region.name}: its recipe rebuilds bytes of sha256 {got}, not the held "
            f"region's {region.sha256}"))
    return None


def recipe_of(layout: ParamLayout, size: int, pieces: Iterator[memoryview],
              model: Path, tensors: list[Tensor]) -> tuple[PlanRegion, set[str]]:
    """The recipe of one held region read as `pieces`, and the tensors it placed."""
    stream = _Stream(pieces)
    found = candidates(layout.slots, tensors)
    placed: set[str] = set()
    parts: list[PlanPart] = []
    for slot in sorted(layout.slots, key=lambda s: s.offset):
        stream.skip_to(slot.offset)
        parts += place(slot, stream.take(slot.nbytes), found[slot.name], model, placed)
    stream.skip_to(size)
    region = PlanRegion(name=layout.region, file="", offset=0, size=size,
                        parts=tuple(sorted(parts, key=lambda c: c.offset)),
                        sha256=stream.sha256.hexdigest())
    return region, placed


def make(socket: Path, digest: str, model: Path,
         device_reader: RegionReader | None = None) -> list[PlanRegion] | Refusal:
    """The verified recipe of every region of the committed set of `digest` in the holder at
    `socket`, from the files in `model`; else why there is none. HolderError when the set
    is not there or cannot be read here."""
    tensors = checkpoint_tensors(model)
    out = []
    with HolderClient(socket) as c:
        backend = c.stats().backend
        regions = c.committed_set(digest)
        if regions is None:
            raise HolderError(f"the holder at {socket} holds no committed set of {digest}")
        for r in regions:
            layout = read_layout(socket.parent, r.name)
            if layout is None or layout.size != r.size:
                return Refusal(RefusalCode.NO_REFILL_RECIPE, (
                    f"{r.name}: the engine that loaded it left no layout of its parameters "
                    f"({layout.size} bytes laid out, {r.size} held)" if layout else
                    f"{r.name}: the engine that loaded it left no layout of its parameters"))
            reader = _reader(r, backend, device_reader)
            with c.attach(r.name) as grant, contextlib.closing(
                    reader.pieces(grant.region, grant.fds)) as pieces:  # type: ignore[type-var]
                region, placed = recipe_of(layout, r.size, pieces, model, tensors)
            refused = check(region, model)
            if refused is not None:
                missing = sorted({t.name for t in tensors} - placed)
                return Refusal(refused.code, f"{refused.detail}; {len(missing)} of "
                               f"{len(tensors)} checkpoint tensors were found in no parameter"
                               + (f" (such as {', '.join(missing[:3])})" if missing else ""))
            out.append(region)
    return out


def _reader(r: RegionInfo, backend: str, device_reader: RegionReader | None) -> RegionReader:
    if r.memory is not MemoryKind.DEVICE:
        return MemfdReader()
    return device_reader or reader_for(backend)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.holder.recipe", description=__doc__)
    ap.add_argument("--socket", type=Path, required=True, help="the holder's socket")
    ap.add_argument("--digest", required=True, help="the weights digest of the committed set")
    ap.add_argument("--model", type=Path, required=True, help="the model's directory")
    args = ap.parse_args(argv)
    try:
        made = make(args.socket, args.digest, args.model)
    except (HolderError, ModelError, OSError) as e:
        print(f"recipe: {e}", file=sys.stderr)
        return 1
    if isinstance(made, Refusal):
        json.dump({"refused": made.detail}, sys.stdout)
    else:
        json.dump({"regions": [r.model_dump(mode="json", exclude_none=True) for r in made]},
                  sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
