"""The recorded canary answer: what a verified engine of this model must answer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.engines.probe import CanaryAnswer
from agent.fsutil import write_private
from agent.store.manifest import Canary, CanaryMethod


@dataclass(frozen=True)
class CanaryRecord:
    """The canary answer recorded for one setup (model files, engine, arguments), and how
    it was produced: an answer is only ever compared with one produced the same way.

    Example::

        rec = CanaryRecord(key, prompt, 8, answer.text, answer.token_ids,
                           CanaryMethod.ONE_PASS_PREFILL)
        rec.matches(probe_answer)
    """

    key: str
    prompt: str
    max_tokens: int
    text: str
    token_ids: tuple[int, ...]
    # What a record without one was made by (before the method was recorded).
    method: CanaryMethod = CanaryMethod.ENGINE_DEFAULT

    def matches(self, answer: CanaryAnswer) -> bool:
        if self.token_ids and answer.token_ids:
            return tuple(self.token_ids) == tuple(answer.token_ids)
        return self.text == answer.text

    @classmethod
    def from_manifest(cls, key: str, c: Canary) -> CanaryRecord:
        return cls(key=key, prompt=c.prompt, max_tokens=c.max_tokens, text=c.text,
                   token_ids=tuple(c.token_ids), method=c.method)

    def to_manifest(self) -> Canary:
        return Canary(prompt=self.prompt, max_tokens=self.max_tokens, text=self.text,
                      token_ids=tuple(self.token_ids), method=self.method)


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
        """The record, or None when there is none or it cannot be read (a method this
        version does not know included): the next verified start records it again."""
        try:
            data = json.loads(self.path.read_text())
            method = CanaryMethod(data.pop("method", CanaryMethod.ENGINE_DEFAULT))
            return CanaryRecord(**{**data, "token_ids": tuple(data["token_ids"]),
                                   "method": method})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, record: CanaryRecord) -> None:
        write_private(self.path, json.dumps(asdict(record), indent=1).encode())

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
