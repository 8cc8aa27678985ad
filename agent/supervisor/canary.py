"""The canary: the recorded answer a verified engine of this model must give, and the check."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.config import Config
from agent.engines.base import EngineAdapter
from agent.engines.probe import CanaryAnswer, EngineProbe
from agent.errors import VerifyError
from agent.fsutil import write_private
from agent.store.manifest import Canary, CanaryMethod

log = logging.getLogger("pitstop.supervisor")


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


class CanaryCheck:
    """Holds a started engine to the recorded canary answer: it must serve the configured
    model and answer the canary as recorded; the first start of a setup records it.

    A record made another way than the engine's current one (an older Pitstop's) is
    checked its own way, then made again.

    Example::

        check = CanaryCheck(CanaryBook(state_dir / "canary.json"), adapter)
        record = await check.verify(config, probe, expected=prepared.canary)  # VerifyError
    """

    def __init__(self, book: CanaryBook, adapter: EngineAdapter) -> None:
        self.book = book
        self._adapter = adapter

    @staticmethod
    def timeout_s(config: Config) -> float:
        # A canary answer is several forward passes: more than a health check may take.
        return max(config.health.timeout_s, 30.0)

    def key(self, config: Config) -> str:
        eng = config.engine
        return setup_key(eng.model, [eng.kind, self._adapter.version(), eng.device, *eng.args])

    async def verify(self, config: Config, probe: EngineProbe,
                     expected: CanaryRecord | None) -> CanaryRecord:
        """The record the engine answered as (`expected`, the rung's, else the book's for
        this setup; a new one when there is none); VerifyError when it did not."""
        name = self._adapter.model_name()
        models = await probe.models()
        if name not in models:
            raise VerifyError(f"engine serves {models}, not the configured model {name!r}")
        if expected is None:
            # Off the loop: it reads a file, lists the model's files and asks the engine's
            # version (for vLLM a subprocess when its packages changed on disk).
            expected = await asyncio.to_thread(self._recorded, config)
        current = self._adapter.canary_method
        method = current if expected is None else expected.method
        answer = await self._ask(config, probe, name, method)
        if expected is None:
            # First start of this setup: its answer becomes the record later starts must match.
            expected = await self._record(config, answer, current)
            log.info("canary recorded for this setup (%s): %r", current.value, answer.text)
        elif not expected.matches(answer):
            raise VerifyError(f"canary answered {answer.text!r} (tokens "
                              f"{list(answer.token_ids)}), expected the recorded "
                              f"{expected.text!r} (tokens {list(expected.token_ids)}, "
                              f"{expected.method.value}): this engine is not the one that "
                              "was recorded")
        elif expected.method is not current:
            answer = await self._ask(config, probe, name, current)
            expected = await self._record(config, answer, current)
            log.info("canary: the record made by %s matched; recorded again by %s: %r",
                     method.value, current.value, answer.text)
        return expected

    def _recorded(self, config: Config) -> CanaryRecord | None:
        canary = config.health.canary
        rec = self.book.load()
        if rec is not None and rec.key == self.key(config) and rec.prompt == canary.prompt \
                and rec.max_tokens == canary.max_tokens:
            return rec
        return None

    async def _ask(self, config: Config, probe: EngineProbe, name: str,
                   method: CanaryMethod) -> CanaryAnswer:
        canary = config.health.canary
        return await probe.canary(name, canary.prompt, canary.max_tokens,
                                  timeout=self.timeout_s(config),
                                  fields=self._adapter.canary_fields(method))

    async def _record(self, config: Config, answer: CanaryAnswer,
                      method: CanaryMethod) -> CanaryRecord:
        canary = config.health.canary
        # Off the loop, as _recorded; the record is written with its fsyncs.
        key = await asyncio.to_thread(self.key, config)
        rec = CanaryRecord(key=key, prompt=canary.prompt, max_tokens=canary.max_tokens,
                           text=answer.text, token_ids=answer.token_ids, method=method)
        await asyncio.to_thread(self.book.save, rec)
        return rec
