"""Fuzzing the real holder's socket: random, truncated and oversized frames get an error
answer (or the session closes), the holder serves its other clients and never exits."""

from __future__ import annotations

import json
import os
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.holder import protocol as p
from tests.holder_proc import Holder

# The oversized frames make hypothesis warn about the size of their repr on failure.
pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")]

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

OPS = ("create", "commit", "attach", "release", "list", "stats", "drop", "nope")
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)
request_like = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 0, 2, "1", None]), "op": st.sampled_from(OPS)},
    optional={"name": st.text(max_size=300), "size": st.integers(-2, 1 << 50),
              "digest": st.text(max_size=200), "parts": st.integers(-1, 200_000),
              "reason": st.text(max_size=20), "detail": st.text(max_size=2000),
              "extra": json_value})
VALID = [b'{"v":1,"op":"stats"}', b'{"v":1,"op":"list"}',
         b'{"v":1,"op":"attach","name":"w/model.safetensors"}']
frames = st.one_of(
    st.binary(min_size=1, max_size=2048),
    request_like.map(lambda d: json.dumps(d).encode()),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.tuples(st.sampled_from(VALID), st.integers(1, 40)).map(lambda t: t[0][:t[1]]),
    # Past the largest message the holder reads: must be refused, never half-read.
    st.tuples(st.sampled_from(VALID), st.integers(p.MAX_MESSAGE - 16, p.MAX_MESSAGE + 4096))
    .map(lambda t: t[0] + b" " * t[1]),
)


@pytest.fixture(scope="module")
def fuzzed_holder(tmp_path_factory):
    h = Holder(tmp_path_factory.mktemp("fuzz") / "holder")
    yield h
    assert h.stop() == 0, h.log.read_text()[-3000:]


def _connect(h: Holder) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(h.sock))
    return s


@FUZZ
@given(frame=frames)
def test_any_frame_gets_an_answer_and_the_holder_serves_on(fuzzed_holder, frame):
    h = fuzzed_holder
    with _connect(h) as s:
        s.send(frame)
        data, fds, _, _ = socket.recv_fds(s, p.MAX_MESSAGE, p.MAX_FDS)
        for fd in fds:
            os.close(fd)
        if data:
            reply = p.parse_reply(data)
            if not reply.ok:
                assert reply.error is not None and reply.error.message
            else:
                # Only a well-formed request is carried out; an oversized one never is.
                assert len(frame) <= p.MAX_MESSAGE
                p.parse_request(frame)
            # The session goes on after a refused request.
            s.send(VALID[0])
            assert p.parse_reply(s.recv(p.MAX_MESSAGE)).ok
    assert h.proc.poll() is None
    assert h.stats().pid == h.proc.pid  # another client is served


def test_an_oversized_frame_is_refused_not_read_in_part(fuzzed_holder):
    with _connect(fuzzed_holder) as s:
        s.send(VALID[0] + b" " * p.MAX_MESSAGE)
        reply = p.parse_reply(s.recv(p.MAX_MESSAGE))
        assert not reply.ok and reply.error is not None
        assert reply.error.code == p.ErrorCode.BAD_REQUEST
        assert str(p.MAX_MESSAGE) in reply.error.message


def test_an_answer_the_client_cannot_read_makes_the_holder_unavailable_not_the_agent_exit(
        tmp_path):
    # A holder of a newer version answers with fields this client does not know.
    import threading

    from agent.errors import HolderUnavailableError
    from agent.holder.client import HolderClient

    path = tmp_path / "holder.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(p.MAX_MESSAGE)
            conn.send(b'{"v": 1, "ok": true, "stats": {"lease_s": 600}}')

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with pytest.raises(HolderUnavailableError, match="same Pitstop version"), \
            HolderClient(path, timeout=5) as c:
        c.stats()
    t.join(5)
    listener.close()
