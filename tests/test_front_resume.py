"""The sent offset: cut a stream anywhere, continue it, and the client sees one answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.front.resume import CHAT, COMPLETIONS, Plan, StopScanner, Tracker
from agent.front.sse import SSEParser
from agent.refusal import RefusalCode

PROMPT = [0, 11, 12, 13]
# (token id, its text) for tokens that each end between two characters.
PIECES = [(40, "Hel"), (41, "lo"), (42, ","), (43, " wor"), (44, "ld"), (45, "\n"), (46, "\n"),
          (47, "Bye"), (48, " now"), (49, ".")]
FULL = "".join(t for _, t in PIECES)
# As vLLM sends them when tokens end inside a UTF-8 character: the id at once, its text with
# the token that completes the character (2, 3 and 4 bytes here).
SPLIT = [(50, "Caf"), (51, ""), (52, "é "), (53, ""), (54, ""), (55, "€"), (56, " 5"),
         (57, ""), (58, ""), (59, ""), (60, "😀"), (61, " ok")]


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def engine_stream(chat: bool, pieces: list[tuple[int, str]], prompt: list[int],
                  finish: str = "length", rid: str = "x-1", usage: bool = False,
                  held: dict[str, Any] | None = None) -> list[bytes]:
    """Events as the reference engine (and vLLM) write them with return_token_ids; `held`:
    the chat delta of a token whose text is held back, when not `{"content": ""}`."""
    env = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": 7, "model": "m"}
    out = []
    if chat:
        out.append(_frame({**env, "prompt_token_ids": prompt, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None, "stop_reason": None, "token_ids": []}]}))
    for i, (tid, text) in enumerate(pieces):
        fin = finish if i == len(pieces) - 1 else None
        if chat:
            delta = held if held is not None and not text else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": fin, "stop_reason": None, "token_ids": [tid]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin,
                      "stop_reason": None, "token_ids": [tid]}
            if i == 0:
                choice["prompt_token_ids"] = prompt
        out.append(_frame({**env, "choices": [choice]}))
    if usage:
        out.append(_frame({**env, "choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": len(pieces),
            "total_tokens": len(prompt) + len(pieces)}}))
    out.append(b"data: [DONE]\n\n")
    return out


def client_view(data: bytes, chat: bool) -> tuple[str, list[dict[str, Any]]]:
    """The text a client assembles, and every object it got (errors included)."""
    text, objs = "", []
    for ev in SSEParser().feed(data):
        if ev.done:
            objs.append({"done": True})
            continue
        obj = json.loads(ev.data)
        objs.append(obj)
        for c in obj.get("choices") or []:
            text += (c["delta"].get("content") or "") if chat else c["text"]
    return text, objs


def run_cut(endpoint: str, body: dict[str, Any], cut: int,
            every: list[tuple[int, str]] = PIECES,
            held: dict[str, Any] | None = None) -> tuple[str, list[dict[str, Any]], Tracker]:
    """Feed the first `cut` events, lose the engine, continue; what does the client get?"""
    chat = endpoint == CHAT
    limit = body.get("max_tokens", 16)
    pieces = every[:limit]
    finish = "length" if len(pieces) == limit else "stop"
    t = Tracker(Plan.of(endpoint, body))
    events = engine_stream(chat, pieces, PROMPT, finish, usage=True, held=held)
    sent = b""
    for ev in events[:cut]:
        sent += t.feed(ev)
        if t.done:
            return (*client_view(sent, chat), t)
    # The engine died here.
    if t.complete:
        sent += t.finished_frames()
        return (*client_view(sent, chat), t)
    assert t.resume_refusal() is None
    path, cont = t.continuation()
    if not t.started:
        assert (path, cont) == (endpoint, Plan.of(endpoint, body).first_body())
        return run_cut(endpoint, body, len(events) + 1, every, held)
    assert path == COMPLETIONS
    n = len(t.out_ids)
    assert cont["prompt"] == PROMPT + [tid for tid, _ in every[:n]]
    # it goes on after a token whose text was sent: never from inside a character
    assert n == 0 or every[n - 1][1]
    assert cont["return_token_ids"] is True and cont["stream"] is True
    assert "stop" not in cont and "stream_options" not in cont
    assert cont["max_tokens"] == limit - n
    t.begin_attempt()
    rest = engine_stream(False, pieces[n:], cont["prompt"], finish, rid="cmpl-new", usage=False)
    for ev in rest:
        sent += t.feed(ev)
    assert t.done
    return (*client_view(sent, chat), t)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_any_cut_gives_the_uninterrupted_text_and_one_identity(endpoint: str) -> None:
    body = {"model": "m", "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT
               else {"prompt": "hi"})}
    for cut in range(0, 14):
        text, objs, t = run_cut(endpoint, body, cut)
        assert text == FULL, cut
        chunks = [o for o in objs if "id" in o]
        assert {o["id"] for o in chunks} == {"x-1"}, cut
        assert {o["created"] for o in chunks} == {7}
        assert all("token_ids" not in json.dumps(o) for o in objs), cut
        assert objs[-1] == {"done": True}
        usage = objs[-2]["usage"]
        assert usage == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}, cut
        finishes = [c["finish_reason"] for o in chunks for c in o["choices"] if
                    c["finish_reason"]]
        assert finishes == ["length"], cut
        if endpoint == CHAT:
            assert all(o["object"] == "chat.completion.chunk" for o in chunks)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_the_cut(endpoint: str, include: bool) -> None:
    body = {"model": "m", "max_tokens": 10, "stream": True, "stop": ["\n\n", "zzz"],
            "include_stop_str_in_output": include,
            **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT
               else {"prompt": "hi"})}
    assert "stop" not in Plan.of(endpoint, body).first_body()
    want = "Hello, world" + ("\n\n" if include else "")
    for cut in range(0, 12):
        text, objs, t = run_cut(endpoint, body, cut)
        assert text == want, cut
        finishes = [c for o in objs for c in o.get("choices") or [] if c["finish_reason"]]
        assert [c["finish_reason"] for c in finishes] == ["stop"], cut
        assert finishes[0]["stop_reason"] == "\n\n"
        assert t.cut and t.done


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("client_ids", [False, True])
def test_a_cut_inside_a_character_continues_from_the_last_whole_one(
        endpoint: str, client_ids: bool) -> None:
    body = {"model": "m", "max_tokens": 12, "stream": True, "return_token_ids": client_ids,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT
               else {"prompt": "hi"})}
    want = "".join(x for _, x in SPLIT)
    for cut in range(0, 16):
        text, objs, t = run_cut(endpoint, body, cut, SPLIT)
        assert text == want, cut
        ids = [i for o in objs for c in o.get("choices") or [] for i in c.get("token_ids") or []]
        assert ids == ([tid for tid, _ in SPLIT] if client_ids else []), cut
        assert objs[-2]["usage"]["completion_tokens"] == 12, cut


@pytest.mark.parametrize("held", [{}, {"content": None}], ids=["empty", "null"])
@pytest.mark.parametrize("client_ids", [False, True])
def test_a_chat_delta_with_no_text_at_all_holds_its_ids_like_an_empty_one(
        held: dict[str, Any], client_ids: bool) -> None:
    # vLLM's chat layer sends `"delta": {}` (and the ids, asked for) for a token whose text
    # its parser holds back: no empty string in the bytes, and still no text sent.
    body = {"model": "m", "max_tokens": 12, "stream": True, "return_token_ids": client_ids,
            "messages": [{"role": "user", "content": "hi"}]}
    for cut in range(0, 15):
        text, objs, t = run_cut(CHAT, body, cut, SPLIT, held)
        assert text == "".join(x for _, x in SPLIT), cut
        ids = [i for o in objs for c in o.get("choices") or [] for i in c.get("token_ids") or []]
        assert ids == ([tid for tid, _ in SPLIT] if client_ids else []), cut
    t = Tracker(Plan.of(CHAT, body))
    for ev in engine_stream(True, SPLIT, PROMPT, held=held)[:5]:  # 'Caf', -, 'é ', -
        t.feed(ev)
    assert t.out_ids == [50, 51, 52]


def test_ids_of_a_split_character_reach_the_client_with_its_text() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 12, "stream": True,
            "return_token_ids": True}
    _, objs, _ = run_cut(COMPLETIONS, body, 99, SPLIT)
    pairs = [(c["text"], c["token_ids"]) for o in objs for c in o.get("choices") or []]
    assert pairs[:6] == [("Caf", [50]), ("", []), ("é ", [51, 52]), ("", []), ("", []),
                         ("€", [53, 54, 55])]
    assert pairs[-2:] == [("😀", [57, 58, 59, 60]), (" ok", [61])]


@pytest.mark.parametrize("client_ids", [False, True])
def test_an_answer_that_ends_inside_a_character_counts_every_token(client_ids: bool) -> None:
    # max_tokens 9: the last two tokens are the start of the emoji, never completed
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True,
            "return_token_ids": client_ids, "stream_options": {"include_usage": True}}
    for cut in range(0, 12):
        text, objs, _ = run_cut(COMPLETIONS, body, cut, SPLIT)
        assert text == "Café € 5", cut
        ids = [i for o in objs for c in o.get("choices") or [] for i in c.get("token_ids") or []]
        assert ids == ([tid for tid, _ in SPLIT[:9]] if client_ids else []), cut
        assert objs[-2]["usage"]["completion_tokens"] == 9, cut


@pytest.mark.parametrize("client_ids", [False, True])
def test_waiting_ids_go_out_with_an_end_event_that_has_none(client_ids: bool) -> None:
    t = Tracker(Plan.of(COMPLETIONS, {"model": "m", "prompt": "hi", "stream": True,
                                      "return_token_ids": client_ids}))
    events = engine_stream(False, SPLIT[:5], PROMPT, finish="length")[:-2]  # no end yet
    end = _frame({"id": "x-1", "object": "text_completion", "created": 7, "model": "m",
                  "choices": [{"index": 0, "text": "", "logprobs": None,
                               "finish_reason": "stop", "stop_reason": None,
                               "token_ids": []}]})
    out = b"".join(t.feed(ev) for ev in [*events, end, b"data: [DONE]\n\n"])
    assert t.out_ids == [50, 51, 52, 53] and t.done
    _, objs = client_view(out, chat=False)
    ids = [i for o in objs for c in o.get("choices") or [] for i in c.get("token_ids") or []]
    assert ids == ([50, 51, 52, 53] if client_ids else [])


def test_client_that_asked_for_ids_gets_them_once() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "stream": True,
            "return_token_ids": True}
    for cut in range(1, 11):
        _, objs, _ = run_cut(COMPLETIONS, body, cut)
        ids = [i for o in objs for c in o.get("choices") or [] for i in c.get("token_ids") or []]
        prompts = [c["prompt_token_ids"] for o in objs for c in o.get("choices") or []
                   if c.get("prompt_token_ids")]
        assert ids == [tid for tid, _ in PIECES], cut
        assert prompts == [PROMPT], cut


def test_lost_after_the_last_token_needs_no_engine() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    # 10 token events: everything but the usage chunk and [DONE] arrived.
    text, objs, t = run_cut(COMPLETIONS, body, 10)
    assert text == FULL and t.resumes == 0
    assert objs[-2]["usage"]["completion_tokens"] == 10 and objs[-1] == {"done": True}


def test_resume_keeps_sampling_and_shrinks_limits() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "temperature": 0.7, "seed": 3, "top_k": 5, "min_tokens": 4,
            "max_completion_tokens": 9, "stop_token_ids": [7], "tools": None}
    t = Tracker(Plan.of(CHAT, body))
    for ev in engine_stream(True, PIECES[:9], PROMPT)[:4]:
        t.feed(ev)
    path, cont = t.continuation()
    assert path == COMPLETIONS
    assert cont["max_tokens"] == 6 and cont["min_tokens"] == 1
    assert {k: cont[k] for k in ("temperature", "seed", "top_k", "stop_token_ids")} == {
        "temperature": 0.7, "seed": 3, "top_k": 5, "stop_token_ids": [7]}
    assert "messages" not in cont and "max_completion_tokens" not in cont


def test_no_limit_continues_to_the_context_end() -> None:
    t = Tracker(Plan.of(CHAT, {"model": "m", "messages": [], "stream": True}))
    for ev in engine_stream(True, PIECES[:9], PROMPT)[:3]:
        t.feed(ev)
    assert t.continuation()[1]["max_tokens"] is None


@pytest.mark.parametrize("body, why", [
    ({"n": 2}, "n or best_of"), ({"logprobs": 2}, "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "structured"),
    ({"prompt": ["a", "b"]}, "several prompts"),
])
def test_what_cannot_be_resumed_says_why(body: dict[str, Any], why: str) -> None:
    plan = Plan.of(COMPLETIONS, {"model": "m", "prompt": "x", "stream": True, **body})
    assert not plan.resumable and plan.refusal is not None
    assert plan.refusal.code is RefusalCode.REQUEST_NOT_RESUMABLE and why in plan.refusal.detail
    assert "return_token_ids" not in plan.first_body()
    t = Tracker(plan)
    t.feed(engine_stream(False, PIECES[:2], PROMPT)[0])
    assert t.resume_refusal() == plan.refusal


def test_engine_error_event_is_passed_on_and_not_resumed() -> None:
    t = Tracker(Plan.of(COMPLETIONS, {"model": "m", "prompt": "x", "stream": True}))
    err = b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
    assert t.feed(err) == err
    refusal = t.resume_refusal()
    assert refusal is not None and refusal.code is RefusalCode.ENGINE_ERROR
    assert "error" in refusal.detail


DEAD = b"EngineCore encountered an issue"


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_an_engine_that_says_it_died_mid_answer_is_resumed_not_shown(endpoint: str) -> None:
    # vLLM, when its engine core dies under a stream: an error event, then [DONE], then exit.
    chat = endpoint == CHAT
    body = {"model": "m", "max_tokens": 10, "stream": True,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    t = Tracker(Plan.of(endpoint, body), dead_marker=DEAD)
    events = engine_stream(chat, PIECES, PROMPT)
    dead = _frame({"error": {"message": DEAD.decode() + " See stack trace (above) for the root "
                             "cause.", "type": "BadRequestError", "code": 400}})
    cut = 4
    sent = b"".join(t.feed(ev) for ev in events[:cut])
    assert t.feed(dead + b"data: [DONE]\n\n") == b""
    assert t.engine_dead and not t.done and not t.engine_error
    assert t.resume_refusal() is None
    path, cont = t.continuation()
    n = len(t.out_ids)
    assert path == COMPLETIONS and cont["prompt"] == PROMPT + [tid for tid, _ in PIECES[:n]]
    t.begin_attempt()
    assert not t.engine_dead
    for ev in engine_stream(False, PIECES[n:], cont["prompt"], rid="cmpl-new"):
        sent += t.feed(ev)
    assert t.done
    text, objs = client_view(sent, chat)
    assert text == FULL
    assert not any("error" in o for o in objs)


def test_an_error_without_the_marker_is_the_engines_answer() -> None:
    t = Tracker(Plan.of(COMPLETIONS, {"model": "m", "prompt": "x", "stream": True}),
                dead_marker=DEAD)
    err = b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
    assert t.feed(err) == err
    assert t.engine_error and not t.engine_dead


def test_stop_scanner_matches_vllm_semantics() -> None:
    s = StopScanner(("ab", "b"), include=False, min_tokens=0)
    assert s.feed("xa", 1) == ("x", None)   # 'a' may start 'ab': held back
    assert s.feed("b!", 2) == ("", "ab")
    s = StopScanner(("ab", "b"), include=False, min_tokens=0)
    out = [s.feed(c, i + 1) for i, c in enumerate("xyzab")]
    assert "".join(o[0] for o in out) == "xyz" and out[-1][1] == "ab"
    # min_tokens: a stop string before the minimum does not count.
    s = StopScanner(("\n",), include=False, min_tokens=2)
    assert s.feed("a\n", 1) == ("a\n", None)
    assert s.feed("b\nc", 3) == ("b", "\n")
    s = StopScanner(("END",), include=True, min_tokens=0)
    assert s.feed("xxEN", 1) == ("xxEN", None)
    assert s.feed("Dyy", 2) == ("D", "END")
    s = StopScanner(("END",), include=False, min_tokens=0)
    assert s.feed("xxEN", 1) == ("xx", None)
    assert s.flush() == "EN"


def test_fast_path_is_not_fooled_by_text_that_looks_like_keys() -> None:
    tricky = [(40, '{"token_ids": [9], "finish_reason": "stop"}'), (41, ', "token_ids": [8]')]
    for sep in ((", ", ": "), (",", ":")):
        t = Tracker(Plan.of(COMPLETIONS, {"model": "m", "prompt": "hi", "stream": True}))
        out = b""
        for ev in engine_stream(False, tricky + PIECES[:3], PROMPT, "length"):
            if b"[DONE]" not in ev:
                ev = b"data: " + json.dumps(json.loads(ev[6:]), separators=sep).encode() + \
                    b"\n\n"
            out += t.feed(ev)
        text, objs = client_view(out, chat=False)
        assert text == "".join(x for _, x in tricky + PIECES[:3])
        assert t.out_ids == [40, 41, 40, 41, 42] and t.finish == "length"
        assert all("token_ids" not in c for o in objs for c in o.get("choices") or [])


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("client_ids", [False, True])
@pytest.mark.parametrize("pieces", [PIECES, SPLIT], ids=["whole", "split"])
def test_any_chunking_gives_the_same_client_bytes(endpoint: str, client_ids: bool,
                                                 pieces: list[tuple[int, str]]) -> None:
    """The fast path (one whole event per read) and reads of several or partial events
    give the client the same bytes, and the tracker the same ids and finish reason."""
    chat = endpoint == CHAT
    body = {"model": "m", "max_tokens": 10, "stream": True, "return_token_ids": client_ids,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    events = engine_stream(chat, pieces, PROMPT, usage=True)
    whole = b"".join(events)

    def fed(chunks: list[bytes]) -> tuple[bytes, list[int], str | None, bool]:
        t = Tracker(Plan.of(endpoint, body))
        out = b"".join(t.feed(c) for c in chunks)
        return out, t.out_ids, t.finish, t.done

    by_event = fed(events)
    assert by_event[1:] == ([tid for tid, _ in pieces], "length", True)
    assert (b"token_ids" in by_event[0]) == client_ids
    assert fed([whole]) == by_event
    assert fed([whole[i:i + 7] for i in range(0, len(whole), 7)]) == by_event
    assert fed([events[0], b"".join(events[1:4]), *events[4:]]) == by_event
    crlf = whole.replace(b"\n", b"\r\n")
    assert fed([e.replace(b"\n", b"\r\n") for e in events]) == by_event
    assert fed([crlf[i:i + 7] for i in range(0, len(crlf), 7)]) == by_event
    # Bytes after [DONE] are never forwarded.
    assert fed([whole + events[1]]) == by_event
