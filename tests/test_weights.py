"""The weights digest on real files: what changes it, and what the stat cache skips."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from agent.errors import WeightsError
from agent.weights import CACHE_NAME, WeightsDigester, is_model_file

# Files written by the test itself are "racy" under the default 2 s guard (a write in the
# same timestamp tick would go unseen) and are never cached; tests of the cache turn the
# guard off, and test_just_written_file_is_not_cached shows the default at work.
NO_RACE = 0


@pytest.fixture
def model(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model, plus a file the engine never reads."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    (d / "README.md").write_text("not loaded by the engine\n")
    return d


def digester(tmp_path: Path, racy_ns: int = NO_RACE) -> WeightsDigester:
    return WeightsDigester(tmp_path / "state" / CACHE_NAME, racy_ns=racy_ns)


def model_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if is_model_file(p.name))


def test_the_file_set_is_what_the_engine_loads(model: Path):
    names = WeightsDigester(None).list_files(model)
    assert "model.safetensors" in names and "config.json" in names
    assert "tokenizer.json" in names and "generation_config.json" in names
    assert "README.md" not in names
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "tokenizer.model", "merges.txt", "chat_template.jinja"):
        assert is_model_file(name), name
    for name in ("README.md", "LICENSE", ".gitattributes", "original"):
        assert not is_model_file(name), name


def test_per_file_sha256_is_sha256sum_and_the_digest_is_stable(model: Path, tmp_path: Path):
    d = digester(tmp_path).digest(model)
    weights = next(f for f in d.files if f.name == "model.safetensors")
    assert weights.sha256 == hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    assert d.digest.startswith("sha256:")
    assert WeightsDigester(None).digest(model).digest == d.digest  # the cache changes nothing


def test_the_cache_skips_an_unchanged_model_and_rehash_reads_everything(
        model: Path, tmp_path: Path):
    (tmp_path / "state").mkdir()
    first = digester(tmp_path).digest(model)
    assert first.bytes_read == model_bytes(model) and first.files_hashed == len(first.files)
    cache = tmp_path / "state" / CACHE_NAME
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600

    # A new digester (as after an agent restart) reads the cache file, not the model.
    again = digester(tmp_path).digest(model)
    assert again.digest == first.digest
    assert again.bytes_read == 0 and again.files_hashed == 0

    forced = digester(tmp_path).digest(model, rehash=True)
    assert forced.digest == first.digest
    assert forced.bytes_read == model_bytes(model)


def test_same_size_rewrite_with_mtime_put_back_changes_the_digest(model: Path, tmp_path: Path):
    (tmp_path / "state").mkdir()
    dg = digester(tmp_path)
    before = dg.digest(model)
    path = model / "model.safetensors"
    st = path.stat()
    # Let the clock tick past the first write even on a coarse-timestamp filesystem.
    time.sleep(0.05)
    with open(path, "r+b") as f:  # same inode, same size, other bytes
        f.seek(st.st_size - 16)
        old = f.read(16)
        f.seek(st.st_size - 16)
        f.write(bytes(b ^ 0xFF for b in old))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after_st = path.stat()
    assert (after_st.st_size, after_st.st_mtime_ns, after_st.st_ino) == (
        st.st_size, st.st_mtime_ns, st.st_ino)
    # Only ctime says it changed: the kernel sets it on every write and utime, and no
    # user process can set it back.
    assert after_st.st_ctime_ns != st.st_ctime_ns

    after = digester(tmp_path).digest(model)
    assert after.digest != before.digest
    assert after.files_hashed == 1 and after.bytes_read == st.st_size


def test_a_file_replaced_by_rename_changes_the_digest(model: Path, tmp_path: Path):
    (tmp_path / "state").mkdir()
    before = digester(tmp_path).digest(model)
    path = model / "config.json"
    st = path.stat()
    tmp = model / ".config.json.new"
    tmp.write_bytes(path.read_bytes().replace(b"{", b"{ ", 1)[: st.st_size])
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
    after = digester(tmp_path).digest(model)
    assert after.digest != before.digest and after.files_hashed == 1


def test_adding_or_removing_a_model_file_changes_the_digest(model: Path, tmp_path: Path):
    (tmp_path / "state").mkdir()
    base = digester(tmp_path).digest(model)
    (model / "NOTES.md").write_text("docs are not weights\n")
    assert digester(tmp_path).digest(model).digest == base.digest

    (model / "added_tokens.json").write_text('{"<extra>": 1024}\n')
    added = digester(tmp_path).digest(model)
    assert added.digest != base.digest
    assert added.files_hashed == 1  # only the new file was read

    (model / "added_tokens.json").unlink()
    assert digester(tmp_path).digest(model).digest == base.digest
    (model / "generation_config.json").unlink()
    assert digester(tmp_path).digest(model).digest != base.digest


def test_just_written_file_is_not_cached(model: Path, tmp_path: Path):
    (tmp_path / "state").mkdir()
    dg = digester(tmp_path, racy_ns=60_000_000_000)  # everything here is younger than 60 s
    dg.digest(model)
    assert dg.digest(model).bytes_read == model_bytes(model)


def test_a_cache_others_could_write_is_ignored(model: Path, tmp_path: Path):
    (tmp_path / "state").mkdir()
    digester(tmp_path).digest(model)
    (tmp_path / "state" / CACHE_NAME).chmod(0o644)
    assert digester(tmp_path).digest(model).bytes_read == model_bytes(model)


def test_missing_model_directory_is_a_clear_error(tmp_path: Path):
    with pytest.raises(WeightsError, match="does not exist; check engine.model"):
        digester(tmp_path).digest(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(WeightsError, match="not a directory"):
        digester(tmp_path).digest(tmp_path / "file")
