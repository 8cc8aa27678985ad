"""The SSE parser and the id-stripping splice, on bytes as servers write them."""

from __future__ import annotations

import json

from agent.front.events import strip_ids
from agent.front.sse import DONE_FRAME, SSEParser, error_frame

STREAM = (b'data: {"id":"a","choices":[{"text":"he"}]}\n\n'
          b": keep-alive\n\n"
          b'data: {"id":"a","choices":[{"text":"llo\\n\\n"}]}\n\n'
          b"data: [DONE]\n\n")


def _events(chunks: list[bytes]) -> list[bytes]:
    p = SSEParser()
    out = [e for c in chunks for e in p.feed(c)]
    assert p.pending == b""
    return [e.data for e in out]


def test_any_chunking_gives_the_same_events() -> None:
    whole = _events([STREAM])
    assert whole == [b'{"id":"a","choices":[{"text":"he"}]}', b"",
                     b'{"id":"a","choices":[{"text":"llo\\n\\n"}]}', b"[DONE]"]
    assert _events([STREAM[i:i + 1] for i in range(len(STREAM))]) == whole
    assert _events([STREAM[:7], STREAM[7:40], STREAM[40:]]) == whole


def test_raw_bytes_are_kept_for_forwarding() -> None:
    p = SSEParser()
    assert b"".join(e.raw for e in p.feed(STREAM)) == STREAM


def test_crlf_and_cr_line_ends_even_split_between_reads() -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    assert _events([crlf[i:i + 1] for i in range(len(crlf))]) == _events([STREAM])
    assert _events([STREAM.replace(b"\n", b"\r")]) == _events([STREAM])


def test_a_read_of_one_whole_line_event_is_taken_as_it_is_only_with_nothing_pending() -> None:
    event = b'data: {"id":"a","choices":[{"text":"he"}]}\n\n'
    p = SSEParser()
    assert p.whole(event)
    assert not p.whole(event + event) and not p.whole(event[:-1])
    assert not p.whole(event.replace(b"\n", b"\r\n")) and not p.whole(b": hi\n\n")
    assert not p.whole(event.replace(b"{", b"{\r", 1))  # a CR ends a line too
    assert not p.whole(event.replace(b'"he"', b'\n"he"'))  # two lines
    assert p.frames(event[:9]) == [] and not p.whole(event)  # a half event is pending
    assert p.frames(event[9:]) == [event] and p.whole(event)
    assert p.frames(b"data: [DONE]\r") == [] and p.pending == b"data: [DONE]\n"
    assert p.frames(b"\r") == [b"data: [DONE]\n\n"] and not p.whole(event)  # a LF may follow
    assert p.frames(b"\n") == [] and p.whole(event)


def test_multiline_data_event_and_named_event() -> None:
    p = SSEParser()
    (ev,) = p.feed(b"event: x\ndata: one\ndata:two\nid: 3\n\n")
    assert ev.data == b"one\ntwo" and ev.event == "x"
    assert not ev.done
    assert p.feed(DONE_FRAME)[0].done


def test_incomplete_event_waits() -> None:
    p = SSEParser()
    assert p.feed(b'data: {"a": 1}\n') == []
    assert p.pending == b'data: {"a": 1}\n'
    assert [e.data for e in p.feed(b"\n")] == [b'{"a": 1}']


def test_error_frame_is_openai_shaped_then_done() -> None:
    evs = SSEParser().feed(error_frame("engine gone", 503))
    body = json.loads(evs[0].data)
    assert body["error"]["message"] == "engine gone" and body["error"]["code"] == 503
    assert evs[1].done


def test_strip_ids_removes_only_the_id_lists() -> None:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": '"token_ids": [1], \\"', "logprobs": None,
                          "finish_reason": None, "stop_reason": None, "token_ids": [5, 6],
                          "prompt_token_ids": [1, 2, 3]}]}
    for sep in ((", ", ": "), (",", ":"), (" ,  ", " :  ")):
        raw = b"data: " + json.dumps(chunk, separators=sep).encode() + b"\n\n"
        out = strip_ids(raw)
        got = json.loads(out[len(b"data: "):])
        want = json.loads(json.dumps(chunk))
        del want["choices"][0]["token_ids"], want["choices"][0]["prompt_token_ids"]
        assert got == want
    # First key of an object, null lists, chat's top-level prompt ids.
    raw = b'data: {"prompt_token_ids": [1, 2], "choices": [{"token_ids": null, "index": 0}]}\n\n'
    assert json.loads(strip_ids(raw)[6:]) == {"choices": [{"index": 0}]}
    assert strip_ids(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
