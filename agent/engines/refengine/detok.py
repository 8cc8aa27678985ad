"""Incremental detokenization with stop strings, emitting token ids and text together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Delta:
    """What one step adds to a request's output; `text` is exactly the text of `token_ids`
    (before a stop string cuts it), so a client that saw these ids saw this text."""

    text: str
    token_ids: list[int]
    stop_string: str | None = None


class Detokenizer:
    """Holds back ids while their text is an incomplete UTF-8 character or could be the start
    of a stop string, then releases ids and text together.

    Example::

        d = Detokenizer(tokenizer.decode, stop=("\\n\\n",))
        delta = d.add(token_id)       # Delta or None (held back)
        rest = d.flush()              # at the end of the request
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._sent_ids = 0
        self._sent_text = ""

    def add(self, token_id: int) -> Delta | None:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        for s in self._stop:
            # search from where a stop string could begin, given what was already sent
            at = text.find(s, max(0, len(self._sent_text) - len(s) + 1))
            if at != -1:
                return self._release(text[:at], stop_string=s)
        if text.endswith("\ufffd") or self._could_start_stop(text):
            return None
        return self._release(text)

    def flush(self) -> Delta | None:
        """Whatever is held back, at the end of the request."""
        if self._sent_ids == len(self._ids):
            return None
        return self._release(self._decode(self._ids))

    def _could_start_stop(self, text: str) -> bool:
        tail = text[len(self._sent_text):]
        return any(
            tail.endswith(s[:n]) for s in self._stop for n in range(1, min(len(s), len(tail) + 1))
        )

    def _release(self, text: str, stop_string: str | None = None) -> Delta:
        delta = Delta(text[len(self._sent_text):], self._ids[self._sent_ids:], stop_string)
        self._sent_ids = len(self._ids)
        self._sent_text = text
        return delta
