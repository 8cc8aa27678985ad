"""The Unix-socket loop the CRIU test workloads share: bind, say "ready PID", answer each
connection's first message."""

import os
import socket
from collections.abc import Callable


def serve(path: str, answer: Callable[[bytes], bytes | None]) -> None:
    """Answer each connection's first message (up to 64 bytes) with `answer(message)`; a
    None answer closes the connection without one. Never returns."""
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            reply = answer(conn.recv(64))
            if reply is not None:
                conn.sendall(reply)
