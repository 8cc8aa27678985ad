"""Fuzzing the configuration: random and truncated YAML is refused with the key named, by the
loader and by `pitstop run --config`, never with a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import Config, parse_text
from agent.errors import ConfigError
from tests.agentproc import REPO

FUZZ = settings(max_examples=400, deadline=None)

# The sections and the keys each takes, as the loader knows them, plus some it does not.
KNOWN = {name: sorted(field.annotation.model_fields)  # type: ignore[union-attr]
         for name, field in Config.model_fields.items()}
scalar = (st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats()
          | st.text(max_size=40))
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=10), inner, max_size=3), max_leaves=8)
section_name = st.sampled_from([*KNOWN, "engin", "extra"])


@st.composite
def configs(draw) -> dict:
    """A mapping shaped like a config: known sections, known and unknown keys, any values."""
    out: dict = {}
    if draw(st.booleans()):
        out["engine"] = {"kind": "reference", "model": "/nonexistent/model"}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(section_name)
        keys = KNOWN.get(section, []) + ["typo_key"]
        body = draw(st.dictionaries(st.sampled_from(keys), value, max_size=4))
        out[section] = body if draw(st.integers(0, 9)) else draw(value)
    return out


def _valid_text() -> str:
    return yaml.safe_dump({
        "engine": {"kind": "reference", "model": "/m", "device": "cpu", "args": ["--x", "1"]},
        "front": {"host": "127.0.0.1", "port": 8000, "queue": {"max_waiting": 4}},
        "snapshots": {"keep": 2, "regenerate": "after-serving"},
        "holder": {"enabled": True, "gpu": "cpu"},
        "health": {"interval_s": 0.5}}, sort_keys=False)


VALID = _valid_text()
texts = st.one_of(
    configs().map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
    st.integers(0, len(VALID)).map(lambda n: VALID[:n]),  # a file cut short
    st.text(max_size=300),  # anything at all
    st.tuples(st.integers(0, len(VALID)), st.text(min_size=1, max_size=5))
    .map(lambda t: VALID[:t[0]] + t[1] + VALID[t[0]:]),  # a stray keystroke
)


def _names_what_is_wrong(msg: str, text: str) -> bool:
    """An error names the file, then where the YAML broke, or for every problem the key it
    is about (starting with a top-level key of the input)."""
    if not msg.startswith("fuzz.yaml: "):
        return False
    body = msg.removeprefix("fuzz.yaml: ")
    if body.startswith("not valid YAML"):
        return "line" in body or "position" in body
    if body.startswith("expected a mapping at the top level"):
        return True
    if not body.startswith("invalid configuration:\n"):
        return False
    tops = [str(k) for k in yaml.safe_load(text) or {}] + [*KNOWN, "(top level)"]
    problems = [ln for ln in body.splitlines()[1:] if ln.startswith("  ")]
    return bool(problems) and all(any(ln[2:].startswith(t) for t in tops) for ln in problems)


@FUZZ
@given(text=texts)
def test_any_text_is_a_config_or_an_error_that_names_the_key(text):
    try:
        cfg = parse_text(text, "fuzz.yaml")
    except ConfigError as e:
        assert _names_what_is_wrong(str(e), text), str(e)
        assert "Traceback" not in str(e)
    else:
        assert isinstance(cfg, Config)


@pytest.mark.parametrize("text", [
    VALID[:len(VALID) // 2],
    VALID.replace("port: 8000", "port: eighty"),
    VALID.replace("keep: 2", "keep: 0"),
    VALID + "mystery: 1\n",
    "engine: [1, 2\n",
    "\x00\x01binary",
])
def test_pitstop_run_exits_2_naming_the_key_and_never_prints_a_traceback(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert str(path) in r.stderr
    assert _names_what_is_wrong(r.stderr.replace(str(path), "fuzz.yaml", 1)
                                .removeprefix("pitstop: "), text), r.stderr
