"""Reading the engine's stream events: the one reader of a token event's ids, finish and text."""

from __future__ import annotations

import json
import re
from typing import Any

from agent.front.sse import event_of, is_plain

# The id lists the front asked for, cut out of an event's bytes without decoding the JSON
# again: a '"' right after '{' or ',' cannot be inside a JSON string (it would be escaped).
_ID_KEYS = re.compile(
    rb',\s*"(?:prompt_)?token_ids"\s*:\s*(?:null|\[[^\]]*\])'
    rb'|"(?:prompt_)?token_ids"\s*:\s*(?:null|\[[^\]]*\])\s*,?')
# An event's ids, finish reason and text, read from its bytes (same structural argument:
# each pattern is matched from the '{' or ',' before its key's quote, so it matches a key of
# an object only); a text's first byte after its opening quote tells whether it is empty.
_DELTA_IDS = re.compile(rb'[,{]\s*"token_ids"\s*:\s*\[([^\]]*)\]')
_FINISH = re.compile(rb'[,{]\s*"finish_reason"\s*:\s*(?:null|"([^"\\]*)")')
_TEXT = re.compile(rb'[,{]\s*"text"\s*:\s*"(.)', re.S)
_CONTENT = re.compile(rb'[,{]\s*"content"\s*:\s*"(.)', re.S)
_SPACE = frozenset(b" \t\r\n")
_COMMA = ord(",")


def _key(pattern: re.Pattern[bytes], key: bytes, raw: bytes) -> re.Match[bytes] | None:
    """`pattern` matched at the last `key` in `raw`, from the byte before it that is not
    white space: None unless that is the '{' or ',' before a key of an object."""
    i = raw.rfind(key)
    if i <= 0:
        return None
    k = i - 1
    while k > 0 and raw[k] in _SPACE:
        k -= 1
    return pattern.match(raw, k)


def strip_ids(raw: bytes) -> bytes:
    """`raw` without the token id lists the front added to the request."""
    return _ID_KEYS.sub(b"", raw) if raw.find(b"token_ids") >= 0 else raw


def delta_has_text(delta: Any) -> bool:
    """Whether a chat delta carries any text (content, or a reasoning parser's fields)."""
    return isinstance(delta, dict) and any(
        isinstance(v, str) and v for k, v in delta.items() if k != "role")


class EngineEvent:
    """One event of the engine's stream: its bytes, its data, and its JSON object, decoded
    only when something needs more of it than its tokens (`tokens_of`).

    Example::

        ev = EngineEvent(b'data: {"choices": [{"text": "a", "token_ids": [7], ...}]}\\n\\n')
        tokens_of(ev, chat=False).ids    # [7], read from the bytes: no JSON decoded
    """

    __slots__ = ("_data", "_decoded", "_obj", "plain", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.plain = is_plain(raw)
        self._data: bytes | None = None
        self._obj: dict[str, Any] | None = None
        self._decoded = False

    @property
    def data(self) -> bytes:
        """Its `data` lines' payload (comments and other fields left out)."""
        if self._data is None:
            self._data = self.raw[6:-2] if self.plain else event_of(self.raw).data
        return self._data

    @property
    def obj(self) -> dict[str, Any] | None:
        """The event's JSON object; None when its data is not one."""
        if not self._decoded:
            self._decoded = True
            try:
                obj = json.loads(self.data)
            except ValueError:
                obj = None
            self._obj = obj if isinstance(obj, dict) else None
        return self._obj


class Tokens:
    """The first choice of one event, as the sent offset counts it: its token ids, its
    finish reason, whether it is `textless` (it neither ends the answer nor brings text: a
    token whose text the engine holds back, inside a UTF-8 character, brings none, and its
    ids wait for a later event's text), and where its id list is in the event's bytes when
    it was read there (`span`, from the ',' or '{' before the key to the list's end)."""

    __slots__ = ("finish", "ids", "span", "textless")

    def __init__(self, ids: list[int], finish: str | None, has_text: bool,
                 span: tuple[int, int] | None = None) -> None:
        self.ids, self.finish, self.span = ids, finish, span
        self.textless = not finish and not has_text


def tokens_of(ev: EngineEvent, chat: bool) -> Tokens | None:
    """The tokens of `ev`'s first choice; None when it has no choice (usage, an error).

    Read from the bytes when the event has the common shape (one line, the ids and finish
    reason the front asked for, a text it can see is empty or not), else from its decoded
    JSON: both give the same answer, so every rule about tokens is applied to one value.
    A completion's text counts unless it is the empty string; a chat delta's when any of
    its fields but the role is a non-empty string."""
    if ev.plain:
        quick = plain_tokens(ev.raw, chat)
        if quick is not None:
            return quick
    obj = ev.obj
    choices = obj.get("choices") if obj is not None else None
    if not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    has_text = delta_has_text(choice.get("delta")) if chat else choice.get("text") != ""
    return Tokens(list(choice.get("token_ids") or ()), choice.get("finish_reason"), has_text)


def plain_tokens(raw: bytes, chat: bool) -> Tokens | None:
    """The tokens read off a one-line event's bytes (`is_plain`); None when its shape
    does not tell them all (an error, no id list, a chat delta whose content is not a
    non-empty string: another field of it, a reasoning parser's, may carry the text).

    JSON writes a quote inside a string escaped, so `""` is in the bytes only where a
    string is empty: without one, a completion's text is not the empty string."""
    # find, not `in`: `bytes in bytes` first tries the needle as an integer and formats
    # the TypeError it clears, which costs more than the search (CPython 3.11).
    if raw.find(b'"error"') >= 0:
        return None
    ids = _key(_DELTA_IDS, b'"token_ids"', raw)
    fin = _key(_FINISH, b'"finish_reason"', raw)
    if ids is None or fin is None:
        return None
    if chat:
        content = _key(_CONTENT, b'"content"', raw)
        if content is None or content.group(1) == b'"':
            return None
        has_text = True
    elif raw.find(b'""') >= 0:
        text = _key(_TEXT, b'"text"', raw)
        if text is None:
            return None
        has_text = text.group(1) != b'"'
    else:
        has_text = True
    got = ids.group(1)
    finish = fin.group(1)
    # One id an event is the rule while tokens stream: int() alone is half of map and list.
    return Tokens([int(got)] if got.isdigit() else _ids(got),
                  None if finish is None else finish.decode(), has_text, ids.span())


def _ids(listed: bytes) -> list[int]:
    return list(map(int, listed.split(b","))) if listed.strip() else []
