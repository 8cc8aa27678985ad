"""Fuzzing the store: random and truncated manifests and sealed records are refused (or read
as the same snapshot), and a snapshot whose image changed is never selected."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.errors import SnapshotError
from agent.store import SnapshotStore
from tests.snapshot_helpers import IDENT, publish

FUZZ = settings(max_examples=300, deadline=None)

json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=3), max_leaves=6)


def _paths(doc: object, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document that a mutation can replace."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: object, path: tuple, new: object) -> object:
    if not path:
        return new
    doc = json.loads(json.dumps(doc))
    node = doc
    for p in path[:-1]:
        node = node[p]  # type: ignore[index]
    node[path[-1]] = new  # type: ignore[index]
    return doc


@st.composite
def damage(draw, original: bytes) -> bytes:
    """What a crash, a bad disk or a hand edit leaves of a JSON file."""
    how = draw(st.sampled_from(["truncate", "bytes", "flip", "value"]))
    if how == "truncate":
        return original[:draw(st.integers(0, len(original) - 1))]
    if how == "bytes":
        return draw(st.binary(max_size=400))
    if how == "flip":
        i = draw(st.integers(0, len(original) - 1))
        return original[:i] + bytes([original[i] ^ draw(st.integers(1, 255))]) + original[i + 1:]
    doc = json.loads(original)
    path = draw(st.sampled_from(_paths(doc)))
    return json.dumps(_replace(doc, path, draw(json_value))).encode()


@st.composite
def cases(draw) -> tuple[str, bool, st.DataObject]:
    return (draw(st.sampled_from(["manifest.json", "sealed.json"])), draw(st.booleans()),
            draw(st.data()))


def _fresh_store() -> tuple[SnapshotStore, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="pitstop-fuzz-store-"))
    store = SnapshotStore(tmp / "snaps", trust_sealed=True)
    store.open(clean=True)
    return store, tmp


@FUZZ
@given(case=cases())
def test_a_damaged_record_is_refused_and_a_changed_image_never_selected(case):
    name, change_image, data = case
    store, tmp = _fresh_store()
    try:
        m = publish(store)
        d = store.path(m.id)
        target = d / name
        original = target.read_bytes()
        target.write_bytes(data.draw(damage(original)))
        if change_image:
            with open(d / "pages-1.img", "r+b") as f:
                b = f.read(1)
                f.seek(0)
                f.write(bytes([b[0] ^ 1]))
        try:
            loaded = store.load(m.id)
        except SnapshotError as e:
            assert m.id in str(e)
            loaded = None
        sel = store.select(IDENT)  # never raises: a bad snapshot is skipped, with a reason
        if sel.chosen is None:
            assert [s.id for s in sel.skipped] == [m.id] and sel.skipped[0].refusal.detail
        else:
            # Chosen only when it still reads as the snapshot that was published and every
            # byte of its image is what was sealed.
            assert not change_image
            assert loaded is not None and loaded.files == m.files
            assert store.verify(m.id, full=True).ok
        assert not store.verify(m.id, full=True).ok or not change_image
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_sealed_record_cannot_vouch_for_an_image_written_after_it(tmp_path):
    store = SnapshotStore(tmp_path / "snaps", trust_sealed=True)
    store.open(clean=True)
    m = publish(store)
    page = store.path(m.id) / "pages-1.img"
    st_before = os.stat(page)
    data = bytearray(page.read_bytes())
    data[0] ^= 0xFF
    page.write_bytes(bytes(data))
    os.utime(page, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # mtime put back
    assert store.select(IDENT).chosen is None  # ctime moved: the file is hashed again


def test_a_manifest_whose_checksum_was_edited_after_the_seal_is_refused(tmp_path):
    store = SnapshotStore(tmp_path / "snaps", trust_sealed=True)
    store.open(clean=True)
    m = publish(store)
    path = store.path(m.id) / "manifest.json"
    doc = json.loads(path.read_text())
    digest = doc["files"][1]["sha256_chunks"][0]
    doc["files"][1]["sha256_chunks"][0] = ("0" if digest[0] != "0" else "1") + digest[1:]
    path.write_text(json.dumps(doc))
    # The image did not change since the seal, but the record of it did: hashed, refused.
    sel = store.select(IDENT)
    assert sel.chosen is None and "sha256 differs" in sel.skipped[0].refusal.detail
