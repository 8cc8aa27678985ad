"""Push and pull against a real S3-compatible server on loopback: what travels, what is
refused and why, and that nothing half-pulled is ever published."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import S3Url
from agent.errors import RemoteError
from agent.refusal import RefusalCode
from agent.store import SnapshotStore
from agent.store.remote import CHUNKS, chunk_key, pull, push
from agent.store.s3 import Bucket
from tests.s3_server import CuttingProxy, S3Server, s3_server
from tests.snapshot_helpers import IDENT, publish

CHUNK = 64 << 10  # small chunks: many objects from a small image


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("aws")) as s:
        yield s


@pytest.fixture
def bucket(server: S3Server, monkeypatch: pytest.MonkeyPatch, request) -> Bucket:
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    name = f"t-{abs(hash(request.node.name)) % 10**9}"
    server.create_bucket(name)
    return Bucket(S3Url.parse(f"s3://{name}/fleet"))


def stores(tmp_path: Path) -> tuple[SnapshotStore, SnapshotStore]:
    """Host A's store and host B's, both empty."""
    a, b = SnapshotStore(tmp_path / "a" / "snaps"), SnapshotStore(tmp_path / "b" / "snaps")
    a.open()
    b.open()
    return a, b


def test_a_pushed_snapshot_comes_back_the_same_under_its_own_id(bucket: Bucket, tmp_path):
    a, b = stores(tmp_path)
    m = publish(a, 5 * CHUNK + 123, chunk=CHUNK)
    sent = push(a, m.id, bucket)
    assert (sent.result, sent.bytes, sent.reused_bytes) == ("ok", m.image_bytes, 0)

    got = pull(b, bucket, IDENT)
    assert (got.result, got.snapshot, got.kind, got.bytes) == ("ok", m.id, "full", m.image_bytes)
    assert b.ids() == [m.id] and b.verify(m.id).ok
    assert b.load(m.id) == m
    for f in m.files:
        assert (b.path(m.id) / f.name).read_bytes() == (a.path(m.id) / f.name).read_bytes()
    # A second pull finds it in place and moves nothing.
    again = pull(b, bucket, IDENT)
    assert (again.bytes, again.detail) == (0, "already in the local store")


def test_a_new_snapshot_uploads_only_the_chunks_the_store_lacks(bucket: Bucket, tmp_path):
    a, _ = stores(tmp_path)
    first = publish(a, 4 * CHUNK, chunk=CHUNK)
    push(a, first.id, bucket)
    assert push(a, first.id, bucket).bytes == 0  # everything is there already
    # The next snapshot shares three of its four pages chunks with the first.
    with a.begin("full") as d:
        d.chunk_bytes = CHUNK
        old = (a.path(first.id) / "pages-1.img").read_bytes()
        (d.dir / "pages-1.img").write_bytes(old[:3 * CHUNK] + os.urandom(CHUNK))
        (d.dir / "core-1.img").write_bytes(b"core")
        second = first.model_copy(update={"id": d.id, "files": d.seal()})
        d.publish(second)
    sent = push(a, second.id, bucket)
    assert (sent.bytes, sent.reused_bytes) == (CHUNK, 3 * CHUNK + 4)


def test_a_tampered_object_is_refused_by_name_and_nothing_is_published(bucket: Bucket,
                                                                       tmp_path):
    a, b = stores(tmp_path)
    m = publish(a, 3 * CHUNK, chunk=CHUNK)
    push(a, m.id, bucket)
    victim = m.files[[f.name for f in m.files].index("pages-1.img")].sha256_chunks[1]
    bucket.put(chunk_key(victim), os.urandom(CHUNK))  # same size, other bytes

    with pytest.raises(RemoteError) as e:
        pull(b, bucket, IDENT)
    assert e.value.refusal.code is RefusalCode.CORRUPT
    assert f"object {bucket.url}/{CHUNKS}/{victim} is corrupt" in str(e.value)
    assert "pages-1.img at byte 65536" in str(e.value)
    assert b.ids() == [] and os.listdir(b.root) == []


def test_an_object_longer_than_its_chunk_or_missing_is_refused(bucket: Bucket, tmp_path):
    a, b = stores(tmp_path)
    m = publish(a, 2 * CHUNK, chunk=CHUNK)
    push(a, m.id, bucket)
    sha = m.files[[f.name for f in m.files].index("pages-1.img")].sha256_chunks[0]
    bucket.put(chunk_key(sha), os.urandom(CHUNK + 1))
    with pytest.raises(RemoteError, match=f"object {bucket.url}/{CHUNKS}/{sha} is longer"):
        pull(b, bucket, IDENT)
    bucket.delete(chunk_key(sha))
    with pytest.raises(RemoteError, match="is incomplete") as e:
        pull(b, bucket, IDENT)
    assert e.value.refusal.code is RefusalCode.CORRUPT
    assert b.ids() == [] and os.listdir(b.root) == []


@pytest.mark.parametrize("field,value", [("kernel", "6.1.0-other"),
                                         ("engine_version", "0.31.0"),
                                         ("weights_digest", "sha256:" + "0" * 64)])
def test_a_host_that_differs_is_refused_naming_the_field(bucket: Bucket, tmp_path,
                                                         field: str, value: str):
    a, b = stores(tmp_path)
    m = publish(a, CHUNK, chunk=CHUNK)
    push(a, m.id, bucket)
    with pytest.raises(RemoteError) as e:
        pull(b, bucket, IDENT.model_copy(update={field: value}))
    assert e.value.refusal.code is RefusalCode.STALE
    assert f"the newest, {m.id}, differs: {field}: " in str(e.value) and value in str(e.value)
    assert b.ids() == []


def test_another_gpu_of_the_same_kind_is_remapped_not_refused(bucket: Bucket, tmp_path):
    a, b = stores(tmp_path)
    on = {"gpu_name": "NVIDIA H200", "gpu_memory_bytes": 150 << 30}
    taken = IDENT.model_copy(update={**on, "gpu_uuid": "GPU-" + "a" * 32,
                                     "env": {"CUDA_VISIBLE_DEVICES": "GPU-" + "a" * 32}})
    m = publish(a, CHUNK, chunk=CHUNK, ident=taken)
    push(a, m.id, bucket)
    here = taken.model_copy(update={"gpu_uuid": "GPU-" + "b" * 32,
                                    "env": {"CUDA_VISIBLE_DEVICES": "GPU-" + "b" * 32}})
    assert pull(b, bucket, here).snapshot == m.id
    # Not another kind of GPU: its name is a field that must match.
    other = here.model_copy(update={"gpu_name": "NVIDIA H100"})
    with pytest.raises(RemoteError, match="gpu_name: 'NVIDIA H200' -> 'NVIDIA H100'"):
        pull(SnapshotStore(tmp_path / "c"), bucket, other)


def test_an_interrupted_download_publishes_nothing(server: S3Server, bucket: Bucket,
                                                   tmp_path, monkeypatch: pytest.MonkeyPatch):
    a, b = stores(tmp_path)
    m = publish(a, 8 * CHUNK, chunk=CHUNK)
    push(a, m.id, bucket)
    proxy = CuttingProxy(server.endpoint, cut_after=CHUNK // 2)
    try:
        for k, v in server.env(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(RemoteError) as e:
            pull(b, Bucket(bucket.url), IDENT)
    finally:
        proxy.close()
    assert e.value.refusal.code is RefusalCode.TRANSFER_FAILED, e.value
    assert proxy.cuts > 0
    assert b.ids() == [] and os.listdir(b.root) == []


def test_vllm_snapshots_stay_on_their_host(bucket: Bucket, tmp_path):
    a, _ = stores(tmp_path)
    m = publish(a, CHUNK, chunk=CHUNK)
    with pytest.raises(RemoteError, match="only full and hybrid"):
        push(a, _as_vllm(a, m.id), bucket)


def _as_vllm(store: SnapshotStore, sid: str) -> str:
    """The same image published again as kind vllm."""
    with store.begin("vllm") as d:
        for f in store.load(sid).files:
            (d.dir / f.name).write_bytes((store.path(sid) / f.name).read_bytes())
        d.publish(store.load(sid).model_copy(update={"id": d.id, "kind": "vllm",
                                                     "files": d.seal()}))
        return d.id
