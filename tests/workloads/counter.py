"""A tiny server for CRIU tests: a counter over a Unix socket; each count is also printed."""

import os
import socket
import sys

path, ballast_mib = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
# Memory with content, so that an image has a known, incompressible size.
ballast = os.urandom(ballast_mib << 20)
count = 0
# --cuda MIB: also hold MIB of GPU memory, whose sum is in every answer (bench/ GPU smoke).
gpu = None
if "--cuda" in sys.argv:
    import torch

    gpu = torch.ones(int(sys.argv[sys.argv.index("--cuda") + 1]) << 18, device="cuda")
# A regular file held open, as engines hold their weights.
held = open(__file__, "rb")  # noqa: SIM115
if os.path.exists(path):
    os.unlink(path)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(8)
print(f"ready {os.getpid()}", flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        data = conn.recv(64)
        if data.startswith(b"inc"):
            count += 1
            print(f"count {count}", flush=True)
            extra = f" {float(gpu.sum().item())}" if gpu is not None else ""
            conn.sendall(f"{count} {len(ballast)}{extra}\n".encode())
