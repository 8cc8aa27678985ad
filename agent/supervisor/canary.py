"""The recorded canary answer: what a verified engine of this model must answer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.fsutil import write_private
from agent.supervisor.probe import CanaryAnswer


@dataclass(frozen=True)
class CanaryRecord:
    """The canary answer recorded for one setup (model files, engine, arguments)."""

    key: str
    prompt: str
    max_tokens: int
    text: str
    token_ids: tuple[int, ...]

    def matches(self, answer: CanaryAnswer) -> bool:
        if self.token_ids and answer.token_ids:
            return tuple(self.token_ids) == tuple(answer.token_ids)
        return self.text == answer.text


def setup_key(model_dir: Path, parts: list[str]) -> str:
    """A cheap fingerprint of the model files (names, sizes, mtimes) and the engine setup."""
    h = hashlib.sha256()
    for p in sorted(model_dir.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(model_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


class CanaryBook:
    """Reads and writes the record in the state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> CanaryRecord | None:
        try:
            data = json.loads(self.path.read_text())
            return CanaryRecord(**{**data, "token_ids": tuple(data["token_ids"])})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, record: CanaryRecord) -> None:
        write_private(self.path, json.dumps(asdict(record), indent=1).encode())

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
