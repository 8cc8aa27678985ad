"""Server-sent events: an incremental parser that keeps each event's bytes, and writers."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

DONE = b"[DONE]"
DONE_FRAME = b"data: [DONE]\n\n"
_LF = ord("\n")


class Event(NamedTuple):
    """One event: its `data` lines joined by newlines, and the exact bytes it came in as."""

    data: bytes
    raw: bytes
    event: str | None = None

    @property
    def done(self) -> bool:
        return self.data.strip() == DONE


class SSEParser:
    """Splits a byte stream into events as bytes arrive, in any chunking.

    Follows the WHATWG event-stream rules that matter between an OpenAI server and a proxy:
    lines end in LF, CRLF or CR; an empty line ends an event; `data:` lines accumulate;
    comment lines (':') and unknown fields are kept in `raw` but carry no data. An event with
    no data line (a bare comment, a keep-alive) is returned with empty `data`, so that a
    proxy can still forward it.

    Example::

        p = SSEParser()
        p.feed(b'data: {"a"') + p.feed(b': 1}\\n\\n')   # -> [Event(data=b'{"a": 1}', ...)]
    """

    def __init__(self) -> None:
        self._buf = b""
        self._skip_lf = False

    def whole(self, chunk: bytes) -> bool:
        """Whether `chunk` is, with nothing pending before it, one whole one-line event
        (`is_plain`): the common read of a streaming answer, which `frames` would return
        as it came (one search for a line end instead of two, and no list)."""
        return (not self._buf and not self._skip_lf and is_plain(chunk)
                and chunk[-1] == _LF and chunk.find(b"\r") < 0)

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete."""
        return self._buf

    def feed(self, chunk: bytes) -> list[Event]:
        return [event_of(raw) for raw in self.frames(chunk)]

    def frames(self, chunk: bytes) -> list[bytes]:
        """The complete events in the bytes so far, each as its raw bytes (LF line ends)."""
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the second half of a CRLF split across two reads
        self._skip_lf = False
        if chunk.find(b"\r") >= 0:  # not `in`: see events.plain_tokens
            # Rare (the servers we front write LF): normalise line ends to LF as they come.
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        end = buf.find(b"\n\n")
        if end >= 0 and end == len(buf) - 2:
            # The common read: exactly one whole event (the first end is the last byte).
            self._buf = b""
            return [buf]
        frames: list[bytes] = []
        start = 0
        while end >= 0:
            frames.append(buf[start:end + 2])
            start = end + 2
            end = buf.find(b"\n\n", start)
        self._buf = buf[start:]
        return frames


def is_plain(raw: bytes) -> bool:
    """Whether a frame is one `data: {...}` line (nearly every event is)."""
    return raw.startswith(b"data: {") and raw.find(b"\n", 6) == len(raw) - 2


def event_of(raw: bytes) -> Event:
    """The event in one frame from `SSEParser.frames`."""
    # Nearly every event is one 'data: ' line: take its payload without line parsing.
    if raw.startswith(b"data: ") and raw.find(b"\n", 6) == len(raw) - 2:
        return Event(data=raw[6:-2], raw=raw)
    return _parse(raw)


def _parse(raw: bytes) -> Event:
    data: list[bytes] = []
    event: str | None = None
    for line in raw.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value.decode("utf-8", "replace")
    return Event(data=b"\n".join(data), raw=raw, event=event)


def data_frame(obj: Any) -> bytes:
    """One `data:` event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def error_body(message: str, code: int, kind: str = "ServiceUnavailableError") -> dict[str, Any]:
    """The OpenAI error shape, as vLLM writes it."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_frame(message: str, code: int = 503, kind: str = "ServiceUnavailableError") -> bytes:
    """An SSE error event followed by [DONE]: the openai client raises APIError on it."""
    return data_frame(error_body(message, code, kind)) + DONE_FRAME
