"""A CRIU test process that keeps state where vLLM does: loopback TCP, /dev/shm, a socket path.

    talker.py SOCK [--peer HOST:PORT]

Each "ping" on the Unix socket SOCK bumps a counter in a /dev/shm file it maps shared and
one in a /dev/shm file mapped under a name since unlinked (as glibc's named semaphores),
sends a byte over its TCP connection, and answers "SHM UNLINKED TCPBYTES". The connection
is to itself (both ends in this process) or, with --peer, to a listener outside it.
"""

import mmap
import os
import socket
import struct
import sys

from serve import serve

path = sys.argv[1]
peer = sys.argv[sys.argv.index("--peer") + 1] if "--peer" in sys.argv else None


def shared(name: str, size: int) -> mmap.mmap:
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    os.close(fd)
    return m


kept = shared(f"pitstop-test-{os.getpid()}", mmap.PAGESIZE)
# As glibc's sem_open makes a named semaphore: a temporary name, mapped, linked to the
# final name, the temporary one unlinked. The mapping's path is gone but the file is not,
# so CRIU links it back under link_remap.N instead of copying it into the image.
gone = shared(f"pitstop-test-{os.getpid()}-tmp", mmap.PAGESIZE)
os.link(f"/dev/shm/pitstop-test-{os.getpid()}-tmp", f"/dev/shm/pitstop-test-{os.getpid()}-sem")
os.unlink(f"/dev/shm/pitstop-test-{os.getpid()}-tmp")

if peer:
    host, port = peer.rsplit(":", 1)
    out = socket.create_connection((host, int(port)))
    back = None
else:
    listener = socket.socket()
    # As servers set it (torch's TCPStore, uvicorn): when the tree is killed, its accepted
    # connection lingers in TIME_WAIT on the listener's port, and CRIU re-binds the
    # listener with the options it had.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    out = socket.create_connection(listener.getsockname())
    back, _ = listener.accept()

carried = 0


def answer(message: bytes) -> bytes | None:
    global carried
    if message.strip() != b"ping":
        return None
    for m in (kept, gone):
        m[:8] = struct.pack("<Q", struct.unpack("<Q", m[:8])[0] + 1)
    out.sendall(b"x")
    if back is not None:
        carried += len(back.recv(1))
    return b"%d %d %d\n" % (struct.unpack("<Q", kept[:8])[0],
                             struct.unpack("<Q", gone[:8])[0], carried)


serve(path, answer)
