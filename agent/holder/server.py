"""The holder process: one per GPU, serving its region table on a private Unix socket."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

from agent.errors import HolderError, HolderInvariantError
from agent.holder import protocol as p
from agent.holder.backends import Backend, GpuFaultError
from agent.holder.refill import DEFAULT_TUNING, Tuning
from agent.holder.refill.refiller import Refiller
from agent.holder.regions import RegionTable, RequestRefused

log = logging.getLogger("pitstop.holder")

# Exit statuses of `pitstop holder`, so the unit and the agent can tell why it stopped.
EXIT_STOPPED = 0
EXIT_INVARIANT = 70   # EX_SOFTWARE: its books broke; held memory was dropped on purpose
EXIT_GPU_FAULT = 74   # EX_IOERR: the GPU faulted; held memory is not to be trusted
SUN_PATH_MAX = 107    # sockaddr_un: 108 bytes, a NUL at the end


@dataclass(eq=False)
class Session:
    conn: socket.socket
    pid: int
    uid: int

    @property
    def allowed(self) -> bool:
        return self.uid in (os.getuid(), 0)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, as the kernel recorded it."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def prepare_directory(base: Path, gpu: str) -> Path:
    """`base/gpu`, made 0700 and checked: ours, a real directory, parents not writable by others."""
    if "/" in gpu or gpu in ("", ".", ".."):
        raise HolderError(f"--gpu {gpu!r} is not a GPU UUID or 'cpu'")
    d = base / gpu
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in (d, *[q for q in d.parents if q.is_relative_to(base)]):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise HolderError(f"{path} is not a directory (a symlink?); remove it")
        if st.st_uid not in (os.getuid(), 0):
            raise HolderError(f"{path} is owned by uid {st.st_uid}; it must be ours or root's")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise HolderError(f"{path} is writable by others (mode {st.st_mode & 0o777:o}); "
                              "chmod go-w it")
    os.chmod(d, 0o700)
    return d


class HolderServer:
    """Serves one backend's memory to tenants of the same uid (or root).

    Example::

        server = HolderServer(make_backend("cpu", "cpu"), Path("/run/pitstop/holder"))
        server.bind()
        raise SystemExit(server.serve())   # until SIGTERM
    """

    def __init__(self, backend: Backend, base: Path, max_bytes: int | None = None,
                 refill_tuning: Tuning = DEFAULT_TUNING, refill_rate: float | None = None
                 ) -> None:
        self.backend = backend
        self.holder_id = uuid.uuid4().hex
        self.table = RegionTable(backend, self.holder_id, max_bytes=max_bytes,
                                 watch=self._watch)
        # pidfds of processes that claim leased regions: readable once the process exits.
        self._pidfds: dict[int, int] = {}
        self.directory = prepare_directory(base, backend.gpu)
        self.path = self.directory / p.SOCKET_NAME
        self._sel = selectors.DefaultSelector()
        self._sessions: dict[int, Session] = {}
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._stop = False
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self.refiller = Refiller(backend, self.table, self.directory,
                                 answer=self._answer_waiters, tuning=refill_tuning,
                                 rate=refill_rate)

    def bind(self) -> None:
        """Take the per-GPU lock, then the socket; a second holder for the GPU is refused."""
        lock = self.directory / p.LOCK_NAME
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise HolderError(f"another holder (pid {other}) already serves {self.path}; "
                              "stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        # We hold the lock, so a socket file left here belongs to a dead holder.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        # sockaddr_un's sun_path is 108 bytes, the last one its terminating NUL.
        if len(os.fsencode(self.path)) > SUN_PATH_MAX:
            raise HolderError(f"the holder's socket {self.path} is {len(os.fsencode(self.path))}"
                              f" bytes long; a Unix socket's path takes at most {SUN_PATH_MAX}:"
                              " give the holder a shorter directory (holder.dir, or"
                              " `pitstop holder --dir`)")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        s.listen(64)
        s.setblocking(False)
        self._listener = s
        self._sel.register(s, selectors.EVENT_READ, self._accept)
        self._sel.register(self.refiller.wakeup, selectors.EVENT_READ, self.refiller.ended)
        log.info("holder %s serving %s (backend %s, gpu %s)", self.holder_id, self.path,
                 self.backend.name, self.backend.gpu)

    def serve(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit status."""
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno())
        old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._on_signal)
        try:
            while not self._stop:
                due = self.table.next_expiry()
                timeout = None if due is None else max(0.0, due - self.table.clock())
                for key, _ in self._sel.select(timeout):
                    key.data(key.fileobj)
                if due is not None:
                    self.table.expire()
            return EXIT_STOPPED
        except HolderInvariantError as e:
            log.critical("%s; stopping and dropping all held memory", e)
            return EXIT_INVARIANT
        except GpuFaultError as e:
            log.critical("%s; stopping and dropping all held memory", e)
            return EXIT_GPU_FAULT
        finally:
            signal.set_wakeup_fd(old_fd)
            for sig, h in old.items():
                signal.signal(sig, h)
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:  # bound: the refill's wakeup is watched too
            self._sel.unregister(self.refiller.wakeup)
        self.refiller.close()
        for sid in list(self._sessions):
            self._drop(sid)
        for pid in list(self._pidfds):
            self._exited(pid)
        freed = self.table.free_all()
        self.table.close()
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.backend.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        log.info("holder stopped; freed %d bytes", freed)

    def _watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.table.exited(pid)  # gone already: its lease starts now
            return
        self._pidfds[pid] = fd
        self._sel.register(fd, selectors.EVENT_READ, lambda _f, pid=pid: self._exited(pid))

    def _exited(self, pid: int) -> None:
        fd = self._pidfds.pop(pid)
        self._sel.unregister(fd)
        os.close(fd)
        self.table.exited(pid)
        log.debug("pid %d exited; the leases of its regions run", pid)

    def _on_signal(self, sock: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            for signum in sock.recv(64):
                log.info("got %s; stopping", signal.Signals(signum).name)
                self._stop = True

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = peer_credentials(conn)
        conn.setblocking(False)
        s = Session(conn=conn, pid=pid, uid=uid)
        if not s.allowed:
            # Answered (FORBIDDEN) and closed at its first request: closing now, with the
            # request unread, would reset the connection before the stranger reads why.
            log.warning("refused pid %d of uid %d: only uid %d and root may use this holder",
                        pid, uid, os.getuid())
        self._sessions[id(s)] = s
        self._sel.register(conn, selectors.EVENT_READ, lambda _c, s=s: self._on_readable(s))
        log.debug("session of pid %d opened", pid)

    def _drop(self, sid: int) -> None:
        s = self._sessions.pop(sid)
        self._sel.unregister(s.conn)
        s.conn.close()
        dropped = self.table.session_closed(s)
        if dropped:
            log.warning("pid %d went away before committing %s; freed", s.pid, ", ".join(dropped))

    def _on_readable(self, s: Session) -> None:
        try:
            data, fds = p.receive(s.conn)
        except BlockingIOError:
            return
        except p.ProtocolError as e:
            self._answer(s, p.error_reply(e.code, str(e)))
            return
        except OSError:
            self._drop(id(s))
            return
        if not data and not fds:
            self._drop(id(s))  # end of stream: the tenant closed or died
            return
        for fd in fds:  # tenants never send fds; don't keep what they did send
            os.close(fd)
        if not s.allowed:
            self._answer(s, p.error_reply(p.ErrorCode.FORBIDDEN,
                                   f"uid {s.uid} may not use this holder (it serves uid "
                                   f"{os.getuid()} and root)"))
            if id(s) in self._sessions:
                self._drop(id(s))
            return
        reply, out_fds = self._handle(s, data)
        if reply is not None:  # None: a refill answers this session when it ends
            self._answer(s, reply, out_fds)
        self._check()

    def _check(self) -> None:
        live = set(self._sessions)
        if self.refiller.writer is not None:
            live.add(id(self.refiller.writer))
        self.table.check(live)

    def _answer(self, s: Session, reply: p.Reply, fds: list[int] | None = None) -> None:
        try:
            data = p.encode(reply)
        except ValueError as e:
            # Too many regions for one datagram: the client can narrow its question.
            reply = p.error_reply(p.ErrorCode.BAD_REQUEST, f"{e}; ask for one digest's regions "
                           '({"op": "list", "digest": ...})')
            data, fds = p.encode(reply), None
        try:
            if fds:
                socket.send_fds(s.conn, [data], fds)
            else:
                s.conn.send(data)
        except (BlockingIOError, OSError) as e:
            # A tenant that stopped reading or went away loses its session (and with
            # it anything it had not committed).
            log.warning("cannot answer pid %d (%s); closing its session", s.pid, e)
            self._drop(id(s))

    def _handle(self, s: Session, data: bytes) -> tuple[p.Reply | None, list[int]]:
        try:
            req = p.parse_request(data)
            t = self.table
            if isinstance(req, p.RefillRequest):
                return self.refiller.request(req.digest, s), []
            if isinstance(req, p.CreateRequest):
                r = t.create(s, req.name, req.size, req.digest, req.parts, req.memory,
                             req.lease_s)
                return p.Reply(ok=True, region=t.info(r)), list(r.allocation.fds)
            if isinstance(req, p.ListRequest):
                regions = [t.info(r) for r in (*t.committed.values(), *t.pending.values())
                           if req.digest is None or r.digest == req.digest]
                return p.Reply(ok=True, regions=regions), []
            if isinstance(req, p.StatsRequest):
                return p.Reply(ok=True, stats=self._stats()), []
            if isinstance(req, p.DropRequest):
                self.refiller.drop(req.reason.value)
                regions, freed = t.drop_all()
                log.warning("dropped all %d regions (%d bytes) at the request of pid %d (%s)%s",
                            regions, freed, s.pid, req.reason,
                            f": {req.detail}" if req.detail else "")
                return p.Reply(ok=True, dropped=p.Dropped(regions=regions, bytes=freed)), []
            if req.op == "commit":
                committed = t.commit(s, req.name)
                self.refiller.committed(committed.digest)
                return p.Reply(ok=True, region=t.info(committed)), []
            if req.op == "attach":
                r = t.attach(req.name, s)
                return p.Reply(ok=True, region=t.info(r)), list(r.allocation.fds)
            return p.Reply(ok=True, region=t.info(t.release(s, req.name))), []
        except p.ProtocolError as e:
            return p.error_reply(e.code, str(e)), []
        except RequestRefused as e:
            return p.error_reply(e.code, str(e)), []

    def _stats(self) -> p.Stats:
        t = self.table
        return p.Stats(holder_id=self.holder_id, pid=os.getpid(), backend=self.backend.name,
                       gpu=self.backend.gpu, bytes_committed=t.bytes_committed,
                       bytes_pending=t.bytes_pending, regions_committed=len(t.committed),
                       regions_pending=len(t.pending), sessions=len(self._sessions))

    def _answer_waiters(self, waiters: list[Session], reply: p.Reply) -> None:
        """A refill ended: tell every session that asked and is still open."""
        for w in waiters:
            if id(w) in self._sessions:
                self._answer(w, reply)
        self._check()


def run_holder(backend_kind: str, gpu: str, base: Path, max_bytes: int | None = None,
               refill_tuning: Tuning = DEFAULT_TUNING, refill_rate: float | None = None,
               refill_at_start: bool = True) -> int:
    """`pitstop holder`: build the backend, bind, tell systemd, start the refill its plan
    asks for, serve until told to stop."""
    from agent.holder.backends import BackendError, make_backend
    from agent.systemd import Notifier

    try:
        backend = make_backend(backend_kind, gpu)
    except BackendError as e:
        raise HolderError(f"holder for {gpu}: {e}") from e
    server = HolderServer(backend, base, max_bytes=max_bytes, refill_tuning=refill_tuning,
                          refill_rate=refill_rate)
    try:
        server.bind()
        if refill_at_start:
            # Ready before the load ends: the agent's refill request joins this load, and
            # the regions stay invisible to tenants until all of them are committed.
            server.refiller.from_plan()
        else:
            server.refiller.prepare()
    except BaseException:
        server.close()
        raise
    notifier = Notifier()
    notifier.ready(f"holding for {gpu} at {server.path}")
    return server.serve()
