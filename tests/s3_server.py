"""A real S3-compatible server on loopback for the tests, and a proxy that cuts transfers.

The server is moto's (`moto[server]`, pinned in the dev extra): a pure-Python S3 server
that installs from PyPI with the other test tools, speaks S3's HTTP API as boto3 sends it
(ListObjectsV2, PUT and ranged GET, multipart) and starts in a thread in about a second.
MinIO ships as a binary download, SeaweedFS and Garage are in no package registry this
project installs from, and Debian's radosgw needs a whole Ceph cluster behind it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.prereq import require

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """Where the server listens, and the AWS settings that reach it: as environment
    variables for a process of this test, and as the files a fleet's nodes would use."""

    endpoint: str
    config_dir: Path

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """What a child needs to reach the server (or `endpoint`, a proxy in front of it)
        through ~/.aws-style files, as an agent on a node does."""
        where = endpoint or self.endpoint
        cfg = self.config_dir / f"config-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
        cfg.write_text(f"[default]\nregion = {REGION}\n"
                       f"endpoint_url = {where}\n")
        return {"AWS_CONFIG_FILE": str(cfg),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.config_dir / "credentials")}

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name=REGION,
                                       aws_access_key_id="test",
                                       aws_secret_access_key="test").create_bucket(Bucket=name)


@contextlib.contextmanager
def s3_server(config_dir: Path) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a port the kernel chose), with test credentials."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        require(False, "moto's S3 server is missing: `make venv` installs the dev extra")
        raise
    # Objects past 1 MiB go to temporary files, not memory: images are hundreds of MB.
    os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(1 << 20))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "credentials").write_text(
        "[default]\naws_access_key_id = test\naws_secret_access_key = test\n")
    try:
        yield S3Server(f"http://{host}:{port}", config_dir)
    finally:
        server.stop()


class CuttingProxy:
    """A TCP proxy to the server that closes each connection once it has passed
    `cut_after` bytes of answers: every object larger than that is cut off mid-transfer
    (a network that fails), while listings and manifests get through."""

    def __init__(self, upstream: str, cut_after: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._cut_after = cut_after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.cuts = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self._upstream) as up:
            threading.Thread(target=self._pipe, args=(client, up), daemon=True).start()
            passed = 0
            while True:
                data = up.recv(65536)
                if not data:
                    return
                if passed + len(data) > self._cut_after:
                    client.sendall(data[:max(0, self._cut_after - passed)])
                    self.cuts += 1
                    # A shutdown, not only a close: the other thread's recv on these
                    # sockets would otherwise keep them open, and the client waiting.
                    for s in (client, up):
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)
                    return
                passed += len(data)
                client.sendall(data)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
