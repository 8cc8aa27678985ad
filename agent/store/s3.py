"""An S3-compatible bucket through boto3 (the s3 extra): the only module that imports it."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from agent.config import S3Url
from agent.extras import Extra, require

# Transfers in flight at once: enough to fill a fast link with 16 MiB objects, few enough
# for a small S3-compatible server (and this machine's two cores in the tests).
CONCURRENCY = 16
# Every image chunk is one object of at most the manifest's chunk_bytes (16 MiB): each goes
# in one PUT and one GET, and the transfer manager runs that many at once. Larger objects
# (none today) would go in parts of this size.
PART_BYTES = 64 << 20


class _Window(io.RawIOBase):
    """`length` bytes of an open file from `offset`, as a seekable file of their own."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._base, self._length, self._pos = fd, offset, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def _target(self, pos: int, whence: int) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        return start + pos


class WindowReader(_Window):
    """`length` bytes of an open file from `offset`, read like a file of their own: what an
    upload of one chunk reads (botocore seeks back to retry or to compute its checksum)."""

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, min(self._length, self._target(pos, whence)))
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self._length - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._base + self._pos)
        buf[:len(data)] = data
        self._pos += len(data)
        return len(data)


class WindowWriter(_Window):
    """Writes into `length` bytes of an open file from `offset`, for the download of one
    chunk (the transfer manager seeks to each part's offset). An object longer than its
    chunk is refused here, before it can write over the next chunk."""

    def __init__(self, fd: int, offset: int, length: int, name: str) -> None:
        super().__init__(fd, offset, length)
        self._name = name

    def writable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = self._target(pos, whence)
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self._pos + len(view) > self._length:
            raise ObjectTooLong(f"object {self._name} is longer than the {self._length} bytes "
                                "its manifest gives this chunk")
        os.pwrite(self._fd, view, self._base + self._pos)
        self._pos += len(view)
        return len(view)


class ObjectTooLong(ValueError):
    """An object holds more bytes than the chunk it is named for."""


def _boto3() -> Any:
    require(Extra.S3, "snapshots in an S3-compatible store (snapshots.remote, `pitstop "
            "snapshot push|pull`)")
    import boto3

    return boto3


class Bucket:
    """One bucket and prefix of an S3-compatible store, reached the way every AWS tool does:
    credentials, region and endpoint from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_REGION, AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), AWS_PROFILE and ~/.aws/config and
    ~/.aws/credentials (boto3's own lookup).

    Example::

        b = Bucket(S3Url.parse("s3://fleet/llama"))
        b.put("manifests/x.json", data); b.get("manifests/x.json")
    """

    def __init__(self, url: S3Url, *, concurrency: int = CONCURRENCY,
                 timeout_s: float = 60.0) -> None:
        boto3 = _boto3()
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.url = url
        self.concurrency = concurrency
        # Path-style addressing works with every S3-compatible server (MinIO, Ceph, a
        # loopback test server) and with AWS; virtual hosts need DNS per bucket.
        config = Config(max_pool_connections=concurrency + 4, connect_timeout=timeout_s,
                        read_timeout=timeout_s, retries={"mode": "standard", "max_attempts": 3},
                        s3={"addressing_style": "path"})
        self.client = boto3.session.Session().client("s3", config=config)
        self._transfer = TransferConfig(max_concurrency=concurrency,
                                        multipart_threshold=PART_BYTES,
                                        multipart_chunksize=PART_BYTES)

    def get(self, key: str) -> bytes | None:
        """The object at `key` under the prefix; None when there is none."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.url.bucket,
                                          Key=self.url.key(key))["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.url.bucket, Key=self.url.key(key), Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.url.bucket, Key=self.url.key(key))

    def names(self, folder: str) -> Iterator[tuple[str, int]]:
        """(name, size) of every object directly under `folder` (relative to the prefix)."""
        base = self.url.key(folder) + "/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.url.bucket, Prefix=base)
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"].removeprefix(base), int(obj["Size"])

    def transfers(self) -> Transfers:
        """Parallel uploads and downloads of many objects (boto3's TransferManager)."""
        from boto3.s3.transfer import create_transfer_manager

        return Transfers(self, create_transfer_manager(self.client, self._transfer))

    @staticmethod
    def errors() -> tuple[type[BaseException], ...]:
        """What a failed request raises (botocore's errors): a caller names the transfer."""
        from botocore.exceptions import BotoCoreError, ClientError

        return (BotoCoreError, ClientError)


class Transfers:
    """Uploads and downloads in flight on one TransferManager; `close(cancel=True)` stops
    the ones not done."""

    def __init__(self, bucket: Bucket, manager: Any) -> None:
        self._bucket = bucket
        self._manager = manager

    def upload(self, key: str, reader: WindowReader) -> Future:
        return self._manager.upload(reader, self._bucket.url.bucket, self._bucket.url.key(key))

    def download(self, key: str, writer: WindowWriter) -> Future:
        return self._manager.download(self._bucket.url.bucket, self._bucket.url.key(key),
                                      writer)

    def close(self, cancel: bool = False) -> None:
        self._manager.shutdown(cancel=cancel)
