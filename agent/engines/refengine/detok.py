"""Incremental detokenization with stop strings, as vLLM's FastIncrementalDetokenizer does it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer

# tokenizers' error when a decode no longer starts with the text already released
# (huggingface/tokenizers src/tokenizer/mod.rs, DecodeStreamError::InvalidPrefix).
_INVALID_PREFIX = "Invalid prefix encountered"


@dataclass(frozen=True)
class Delta:
    """What one generated token adds to a request's output.

    `token_ids` is always the one new token; `text` is what may be shown now, which can be
    empty while the token ends inside a UTF-8 character (or, with stop strings, inside the
    last max(len(stop)) - 1 characters): that text comes with a later token, or never if
    the answer ends first. vLLM streams exactly these pairs.
    """

    text: str
    token_ids: list[int]
    stop_string: str | None = None


class Detokenizer:
    """One request's output text, token by token, with what vLLM 0.32 holds back.

    Text comes from `tokenizers`' DecodeStream primed with the prompt (vLLM's
    FastIncrementalDetokenizer does the same): it releases text only when the decode of the
    ids so far does not end in U+FFFD, so bytes of an incomplete character wait for the
    token that completes them. Stop strings are searched in the released text; while a
    request runs, the last max(len(stop)) - 1 characters are held back, as vLLM does.

    Example::

        d = Detokenizer(tokenizer.backend, prompt_ids, stop=("\\n\\n",))
        delta = d.add(token_id)                  # Delta; delta.stop_string when one matched
        tail = d.finish()                        # the held-back text, at the end
    """

    def __init__(self, tokenizer: HfTokenizer, prompt: list[int],
                 stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all released text, cut at a matched stop string
        self._sent = 0  # how much of `text` has gone out in deltas

    def add(self, token_id: int, stop_terminated: bool = False) -> Delta:
        """The delta for `token_id`. `stop_terminated`: the token ends the request as EOS
        or one of stop_token_ids, and like vLLM its text is left out."""
        stop = None
        if not stop_terminated:
            piece = self._step(token_id)
            self.text += piece
            stop = self._find_stop(len(piece))
        end = len(self.text) - (self._hold if stop is None else 0)
        return Delta(self._take(end), [token_id], stop)

    def finish(self) -> str:
        """The text still held back for stop strings, when the request ends another way.
        Incomplete UTF-8 at the very end is never released, as in vLLM."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent:end], end
        return out

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except Exception as e:  # the Rust side raises plain Exception
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # A decode that rewrote text already released (non-monotonic byte-level
            # output): start a stream with no context, as vLLM does (vLLM issue 17448).
            self._stream = DecodeStream(skip_special_tokens=True)
            return self._stream.step(self._tok, token_id) or ""

    def _find_stop(self, new_chars: int) -> str | None:
        # vLLM's check_stop_strings: a match must end in the new text; the first stop
        # string to complete wins, ties in list order; the text ends where the match begins.
        if not new_chars or not self._stop:
            return None
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            at = self.text.find(s, max(0, len(self.text) - new_chars - len(s) + 1))
            if at != -1 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        if best is None:
            return None
        self.text = self.text[:best[1]]
        return best[2]
