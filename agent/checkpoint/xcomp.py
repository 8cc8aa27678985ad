"""Give restored processes back the AMX permission that CRIU does not restore."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import os
import signal
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import SnapshotError
from agent.proc import pid_alive

# Linux lets a process execute AMX tile instructions only once it asked for the
# permission, process-wide: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
# (Documentation/arch/x86/xstate.rst). oneDNN asks once, at start. CRIU 4.1 and 4.2 do
# not save that permission, so a restored process that had it dies with SIGILL at its
# next tile instruction. The agent asks again on its behalf: it runs the arch_prctl
# system call inside each restored process, through ptrace, before the tree runs.
SYS_GETPID = 39
SYS_GETPPID = 110
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

AMX_REQUEST = "the AMX re-grant (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)"
PTRACE_CONT = 7
PTRACE_SINGLESTEP = 9
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_DETACH = 17
PTRACE_GETSIGINFO = 0x4202
PTRACE_SETSIGINFO = 0x4203
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128
WALL = 0x40000000  # __WALL: wait for the thread we trace, whatever its kind
SYSCALL_INSN = b"\x0f\x05"
SIGINFO_SIZE = 128
STOP_TIMEOUT_S = 5.0
AT_SYSINFO_EHDR = 33  # the auxiliary vector's entry for where the vDSO's ELF image is
ELF64_HEADER = struct.Struct("<4s36xQ10xHH")  # magic; e_shoff; e_shentsize, e_shnum
VDSO_MAX = 1 << 16
# A single step can be pre-empted by a stop that is not its own (a group-stop re-trap,
# a signal arriving meanwhile); each is taken and the step asked again, this many times.
MAX_STEPS = 32


class Regrant(enum.Enum):
    """When a restore asks for the AMX permission again in each restored process."""

    AUTO = "auto"  # only where the CPU has AMX: elsewhere no process can have had it
    ALWAYS = "always"  # also without AMX (the kernel refuses; the path itself is exercised)
    OFF = "off"  # never: a restored AMX user dies with SIGILL (what the tests show)

    def active(self, proc_root: Path = Path("/proc")) -> bool:
        if self is Regrant.AUTO:
            return cpu_has_amx(proc_root)
        return self is Regrant.ALWAYS


class Grant(enum.Enum):
    """What arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) answered inside one process."""

    GRANTED = "granted"
    NO_AMX = "no_amx"  # EINVAL / EOPNOTSUPP: this CPU or kernel has no AMX to grant


class _Regs(ctypes.Structure):
    """struct user_regs_struct of x86-64 (sys/user.h), what PTRACE_GETREGS fills."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
        "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base",
        "gs_base", "ds", "es", "fs", "gs",
    )]  # fmt: skip


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def cpu_has_amx(proc_root: Path = Path("/proc")) -> bool:
    """Whether the CPU (as the kernel reports it) has AMX tiles: `amx_tile` in its flags."""
    try:
        text = (proc_root / "cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return "amx_tile" in line.split(":", 1)[-1].split()
    return False


@dataclass(frozen=True)
class _Stop:
    """One ptrace-stop of the thread: the signal, and the PTRACE_EVENT (0 for none)."""

    sig: int
    event: int


class _Tracee:
    """One thread, seized and stopped, to run system calls in; detached on leaving."""

    def __init__(self, pid: int, tid: int, timeout_s: float, purpose: str) -> None:
        self.pid, self.tid, self._timeout, self._purpose = pid, tid, timeout_s, purpose
        # Signals the thread dequeued while we held it, with their siginfo: none may run
        # a handler on our registers, so each is held back and handed over at detach.
        self.deferred: list[tuple[int, bytes]] = []

    def ptrace(self, request: int, addr: int = 0, data: object = None, what: str = "") -> None:
        if _libc.ptrace(request, self.tid, addr, data) != 0:
            e = ctypes.get_errno()
            raise self.error(f"{what or request} failed: {os.strerror(e)}", e)

    def error(self, what: str, err: int = 0) -> SnapshotError:
        hint = ""
        if err in (errno.EPERM, errno.EACCES):
            hint = "; the agent needs root or CAP_SYS_PTRACE"
        return SnapshotError(
            f"cannot run {self._purpose} in PID {self.pid} (thread {self.tid}): "
            f"ptrace {what}{hint}"
        )

    def wait_stop(self) -> _Stop:
        deadline = time.monotonic() + self._timeout
        pause = 0.00005
        while True:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError as e:
                raise self.error("wait: the process is gone (reaped by someone else?)") from e
            if got:
                break
            if time.monotonic() > deadline:
                raise self.error(f"wait: no stop within {self._timeout:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            how = (f"exited with status {os.WEXITSTATUS(status)}" if os.WIFEXITED(status)
                   else f"was killed by {signal.Signals(os.WTERMSIG(status)).name}")  # fmt: skip
            raise self.error(f"wait: the process {how}")
        return _Stop(os.WSTOPSIG(status), status >> 16)

    def defer(self, sig: int) -> None:
        info = ctypes.create_string_buffer(SIGINFO_SIZE)
        self.ptrace(PTRACE_GETSIGINFO, 0, info, "GETSIGINFO")
        self.deferred.append((sig, info.raw))

    def detach(self) -> int:
        """Detach, giving back the first held signal with its own siginfo (the thread
        is in a signal-delivery-stop, whose signal DETACH may replace); any others are
        sent again, with plain siginfo. 0, or the errno DETACH failed with."""
        sig = 0
        if self.deferred:
            sig, raw = self.deferred[0]
            info = ctypes.create_string_buffer(raw, SIGINFO_SIZE)
            if _libc.ptrace(PTRACE_SETSIGINFO, self.tid, None, info) != 0:
                sig = 0
        rc = _libc.ptrace(PTRACE_DETACH, self.tid, None, sig)
        err = ctypes.get_errno() if rc != 0 else 0
        for later, _ in self.deferred[1 if sig else 0 :]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, later)
        return err

    def get_regs(self) -> _Regs:
        regs = _Regs()
        self.ptrace(PTRACE_GETREGS, 0, ctypes.byref(regs), "GETREGS")
        return regs

    def set_regs(self, regs: _Regs) -> None:
        self.ptrace(PTRACE_SETREGS, 0, ctypes.byref(regs), "SETREGS")

    def syscall_address(self, regs: _Regs, proc_root: Path) -> int:
        """An address in the process holding a `syscall` instruction: one in its vDSO
        (the kernel's fallback paths have several), else the one its rip is at or just
        after. Executing those two bytes alone runs a system call whatever code they
        were part of, and nothing is written into the process."""
        mem = proc_root / str(self.pid) / "mem"
        try:
            fd = os.open(mem, os.O_RDONLY)
        except OSError as e:
            raise self.error(f"cannot open {mem}: {e.strerror}", e.errno or 0) from e
        try:
            spans = _vdso(self.pid, fd, proc_root)
            spans += [(regs.rip, regs.rip + 2), (regs.rip - 2, regs.rip)]
            for lo, hi in spans:
                try:
                    found = os.pread(fd, hi - lo, lo).find(SYSCALL_INSN)
                except OSError:
                    continue
                if found >= 0:
                    return lo + found
        finally:
            os.close(fd)
        raise self.error(f"no `syscall` instruction found in its vDSO or at rip {regs.rip:#x}")

    def step_syscall(self, at: int) -> int:
        """Single-step the `syscall` at `at` (rip was set to it); its return value."""
        for _ in range(MAX_STEPS):
            self.ptrace(PTRACE_SINGLESTEP, 0, None, "SINGLESTEP")
            stop = self.wait_stop()
            if stop.sig == signal.SIGTRAP and stop.event == 0:
                regs = self.get_regs()
                if regs.rip == at + 2:
                    return ctypes.c_longlong(regs.rax).value
            elif stop.event == 0:
                self.defer(stop.sig)  # a signal dequeued before our instruction ran
        raise self.error(f"SINGLESTEP: the system call did not complete in {MAX_STEPS} steps")


def _vdso(pid: int, mem_fd: int, proc_root: Path) -> list[tuple[int, int]]:
    """Where the process's vDSO is: from its auxiliary vector (AT_SYSINFO_EHDR) and the
    size its ELF header gives, since /proc/PID/maps of an engine is thousands of lines
    (4 ms to read, for each restored process); from the maps where that fails."""
    with contextlib.suppress(OSError, struct.error):
        raw = (proc_root / str(pid) / "auxv").read_bytes()
        words = struct.unpack(f"<{len(raw) // 8}Q", raw[: len(raw) // 8 * 8])
        base = dict(zip(words[::2], words[1::2], strict=False)).get(AT_SYSINFO_EHDR, 0)
        if base:
            magic, shoff, shentsize, shnum = ELF64_HEADER.unpack(
                os.pread(mem_fd, ELF64_HEADER.size, base))
            size = shoff + shentsize * shnum  # the section headers end the image
            if magic == b"\x7fELF" and 0 < size <= VDSO_MAX:
                return [(base, base + size)]
    spans = []
    with contextlib.suppress(OSError):
        for line in (proc_root / str(pid) / "maps").read_text().splitlines():
            if line.endswith("[vdso]"):
                lo, hi = line.split()[0].split("-")
                spans.append((int(lo, 16), int(hi, 16)))
    return spans


def _thread(pid: int, proc_root: Path, purpose: str) -> int:
    """A live thread of `pid` to run the call in: the leader unless it already exited."""
    try:
        tids = sorted(int(t) for t in os.listdir(proc_root / str(pid) / "task"))
    except OSError as e:
        raise SnapshotError(f"PID {pid} is gone before {purpose}: {e}") from e
    for tid in ([pid] if pid in tids else []) + tids:
        with contextlib.suppress(OSError, IndexError):
            stat = (proc_root / str(pid) / "task" / str(tid) / "stat").read_text()
            if stat[stat.rindex(")") + 2] not in "ZX":
                return tid
    raise SnapshotError(f"PID {pid} has no live thread to run {purpose} in")


def inject_syscall(
    pid: int,
    nr: int,
    *args: int,
    proc_root: Path = Path("/proc"),
    timeout_s: float = STOP_TIMEOUT_S,
    purpose: str = "",
) -> int:
    """Run system call `nr(args)` inside process `pid` and return what it returned
    (a negative errno on failure). The process may be running, blocked in a system
    call or stopped; it continues as it was: its registers are put back, so a system
    call it was blocked in restarts, and a stopped process stays stopped. Needs the
    right to ptrace it (root or CAP_SYS_PTRACE). Raises SnapshotError naming the PID
    and `purpose` (what the call is for, in words).

    Example::

        inject_syscall(pid, SYS_GETPID) == pid
    """
    purpose = purpose or f"system call {nr}"
    t = _Tracee(pid, _thread(pid, proc_root, purpose), timeout_s, purpose)
    t.ptrace(PTRACE_SEIZE, 0, None, "SEIZE")
    saved: _Regs | None = None
    try:
        t.ptrace(PTRACE_INTERRUPT, 0, None, "INTERRUPT")
        while (stop := t.wait_stop()).event != PTRACE_EVENT_STOP:
            # A signal-delivery-stop came first: hold the signal back; our INTERRUPT is
            # still pending, so the thread stops again at once, for us.
            t.defer(stop.sig)
            t.ptrace(PTRACE_CONT, 0, None, "CONT")
        saved = t.get_regs()
        at = t.syscall_address(saved, proc_root)
        call = _Regs.from_buffer_copy(saved)
        call.rax, call.rip = nr, at
        # orig_rax -1: the kernel must not take the stop we are in for an interrupted
        # system call and "restart" it into our registers.
        call.orig_rax = ctypes.c_ulonglong(-1).value
        for reg, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            setattr(call, reg, ctypes.c_ulonglong(value).value)
        t.set_regs(call)
        result = t.step_syscall(at)
        # The saved registers hold the interrupted system call (orig_rax, rax
        # -ERESTART*), so on detach the kernel restarts it exactly as it would have.
        t.set_regs(saved)
        saved = None
    finally:
        if saved is not None:
            with contextlib.suppress(SnapshotError):
                t.set_regs(saved)
        err = t.detach()
    if err:
        raise t.error(f"DETACH failed: {os.strerror(err)}")
    return result


def request_amx(pid: int, proc_root: Path = Path("/proc")) -> Grant:
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) inside `pid`. Asking again
    is harmless where it is granted already; a CPU without AMX answers NO_AMX."""
    rc = inject_syscall(pid, SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA,
                        proc_root=proc_root, purpose=AMX_REQUEST)  # fmt: skip
    if rc == 0:
        return Grant.GRANTED
    if -rc in (errno.EINVAL, errno.EOPNOTSUPP):
        return Grant.NO_AMX
    why = {
        errno.ENOSPC: " (a thread's sigaltstack is too small for AMX signal frames)",
        errno.EPERM: " (most likely a seccomp filter of the engine that forbids arch_prctl)",
    }.get(-rc, "")
    raise SnapshotError(
        f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) in restored PID {pid} was refused: "
        f"{os.strerror(-rc)}{why}; restored without it, a process that uses AMX dies with "
        "SIGILL at its next tile instruction"
    )


def request_amx_self() -> Grant:
    """The same request from inside: what an engine's own resume hook calls, so that a
    restore done by something other than the agent is covered too. Raises OSError when
    the kernel refuses for another reason than a missing AMX."""
    _libc.syscall.restype = ctypes.c_long
    if _libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
        return Grant.GRANTED
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.EOPNOTSUPP):
        return Grant.NO_AMX
    raise OSError(err, f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA): {os.strerror(err)}")


def process_tree(root: int, proc_root: Path = Path("/proc")) -> list[int]:
    """`root` and its descendants, parents first, read from each thread's
    /proc/PID/task/TID/children (as CRIU's own dump does): a walk of the tree alone, not
    of every process on the host, so the restore waits milliseconds less."""
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        with contextlib.suppress(OSError):
            for tid in sorted(os.listdir(proc_root / str(pid) / "task"), key=int):
                with contextlib.suppress(OSError):
                    text = (proc_root / str(pid) / "task" / tid / "children").read_text()
                    todo.extend(int(c) for c in text.split())
    return tree


def regrant_tree(pids: Iterable[int], proc_root: Path = Path("/proc")) -> dict[int, Grant]:
    """The AMX permission asked for again in every process of a restored, stopped tree.
    Zombies (CRIU restores them too) run no code and are left out."""
    return {pid: request_amx(pid, proc_root) for pid in pids if pid_alive(pid, proc_root)}


def continue_tree(pids: Iterable[int]) -> None:
    """SIGCONT each process that `criu restore --leave-stopped` left stopped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError as e:
            raise SnapshotError(f"restored PID {pid} died before it was continued") from e
