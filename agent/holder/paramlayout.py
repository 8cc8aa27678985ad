"""Where each parameter lies in an engine's held region: the engine writes it, the recipe reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ModelError
from agent.fsutil import read_owned, write_private

# Beside the holder's socket (its per-GPU directory), one file per held region: the engine
# that laid the region out (vLLM's plugin) knows it; the agent's recipe maker reads it.
LAYOUT_DIR = "layouts"
# A layout of a few thousand parameters is some hundred KB; past this it is not one.
MAX_LAYOUT_BYTES = 64 << 20


@dataclass(frozen=True)
class ParamSlot:
    """One parameter: its name in the engine, where its bytes start in the region, how many."""

    name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ParamLayout:
    """A held region's parameters, as the engine laid them out."""

    region: str
    size: int
    slots: tuple[ParamSlot, ...]

    def to_json(self) -> bytes:
        return json.dumps({"region": self.region, "size": self.size,
                           "slots": [[s.name, s.offset, s.nbytes] for s in self.slots]}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ParamLayout:
        try:
            raw = json.loads(data)
            slots = tuple(ParamSlot(str(n), int(o), int(b)) for n, o, b in raw["slots"])
            layout = cls(str(raw["region"]), int(raw["size"]), slots)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"not a parameter layout: {e}") from e
        for s in slots:
            if s.offset < 0 or s.nbytes < 0 or s.offset + s.nbytes > layout.size:
                raise ModelError(f"parameter {s.name} lies outside its region "
                                 f"({s.offset}+{s.nbytes} > {layout.size})")
        return layout


def layout_file(directory: Path, region: str) -> Path:
    """The file of `region`'s layout in the holder's directory `directory`."""
    return Path(directory) / LAYOUT_DIR / (region.replace("/", "--").replace(":", "-") + ".json")


def write_layout(directory: Path, layout: ParamLayout) -> Path:
    path = layout_file(directory, layout.region)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_private(path, layout.to_json())
    return path


def read_layout(directory: Path, region: str) -> ParamLayout | None:
    """`region`'s layout, None when none was written; ModelError when it is not one, or
    another region's, or not ours (whoever writes it steers where bytes are looked for)."""
    path = layout_file(directory, region)
    data = read_owned(path, "a parameter layout", MAX_LAYOUT_BYTES)
    if data is None:
        return None
    layout = ParamLayout.from_json(data)
    if layout.region != region:
        raise ModelError(f"{path}: the layout of {layout.region}, not of {region}")
    return layout
