"""A process that holds one kind of socket for the connection survey's tests, until stdin ends.

Modes: unix-connect PATH, unix-listen PATH, dgram-connect PATH, hold FD, tcp-connect HOST PORT,
tcp-listen HOST, tcp-self, tree-pair. It prints "ready INFO" once the socket is in place.
"""

import socket
import subprocess
import sys

mode, args = sys.argv[1], sys.argv[2:]
held: list[socket.socket] = []
info = ""
if mode == "unix-connect":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(args[0])
    held.append(s)
elif mode == "unix-listen":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(args[0])
    s.listen(4)  # never accepts: a client's connection stays queued
    held.append(s)
elif mode == "dgram-connect":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.connect(args[0])
    held.append(s)
elif mode == "hold":
    held.append(socket.socket(fileno=int(args[0])))
elif mode == "tcp-connect":
    family = socket.AF_INET6 if ":" in args[0] else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.connect((args[0], int(args[1])))
    held.append(s)
    info = str(s.getsockname()[1])
elif mode == "tcp-listen":
    family = socket.AF_INET6 if ":" in args[0] else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((args[0], 0))
    s.listen(4)  # never accepts
    held.append(s)
    info = str(s.getsockname()[1])
elif mode == "tcp-self":
    # A loopback pair with both ends in this process, as vLLM's workers hold them.
    lst = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(lst.getsockname())
    a, _ = lst.accept()
    held += [lst, c, a]
elif mode == "tree-pair":
    # One end here, the other in a child: a connection inside a two-process tree.
    mine, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "hold", str(theirs.fileno())],
                             pass_fds=(theirs.fileno(),), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline().startswith(b"ready")
    theirs.close()
    held.append(mine)
    info = str(child.pid)
else:
    sys.exit(f"unknown mode {mode!r}")
print(f"ready {info}".strip(), flush=True)
sys.stdin.read()
