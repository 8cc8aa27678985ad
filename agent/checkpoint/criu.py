"""CRIU dump and restore of one process tree, a log per operation, the first error surfaced."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint.criu_locate import CriuBinary
from agent.commands import CommandResult, Runner, run
from agent.errors import CommandError, SnapshotError

# Flags and why (docs/snapshots.md has the long form):
#   --ext-unix-sk   a Unix datagram socket connected to a named socket outside the
#                   tree is reconnected by name on restore. A stream connection with
#                   one end outside still fails the dump (criu/sk-unix.c);
#                   checkpoint/connections.py refuses those first, naming them.
#   --link-remap    files that are open but unlinked (torch/tempfile scratch) are
#                   linked back under a temporary name so they can be dumped.
#   --file-locks    flock/posix locks the engine holds are dumped and retaken.
#   --tcp-established  when the tree holds TCP connections (vLLM's workers and its
#                   torch.distributed store do, over loopback). Needs CRIU >= 4.2 on
#                   Linux >= 6.16 (CRIU issue 2705).
#   --network-lock  with --tcp-established: `skip` when both ends of every connection
#                   are in the tree (connections.refuse_outside_connections checks),
#                   since CRIU's default (iptables) is often not installed.
#   --shell-job     only when asked: the engine shares a session or terminal with
#                   something outside the tree. The supervisor starts the engine with
#                   its own session (setsid) and stdin /dev/null, so it is not needed.
# The engine's stdout/stderr are pipes to the agent. CRIU dumps them as pipes with
# a peer outside the tree; restore takes `--inherit-fd fd[N]:pipe:[INODE]` to wire
# the old pipe's inode to a new pipe the agent made, passed to CRIU as fd N.
COMMON_FLAGS = ("--ext-unix-sk", "--file-locks")


class NetworkLock(enum.Enum):
    """What CRIU does to keep TCP peers quiet while the tree is frozen (`--network-lock`)."""

    # Nothing: sound only when both ends of every connection are frozen in the same tree.
    SKIP = "skip"
    # nftables rules drop the connections' packets (CRIU built with libnftables, as
    # Debian's 4.2 is): for a dump that stops the tree while a peer outside waits.
    NFTABLES = "nftables"
DUMP_ONLY_FLAGS = ("--link-remap",)


# CRIU's log level for a restore unless snapshots.restore_log_level says otherwise: warnings
# and errors. At 4 (debug) CRIU writes a line per mapping and file, about 33,000 for vLLM 0.33
# on a GPU, each a write on the restore's path: 36-56 ms on the CPU (docs/performance.md).
RESTORE_VERBOSITY = 2

# The longest one `criu dump` or `criu restore` may run before it is killed: tens of GB of
# pages at the speed of a slow disk.
CRIU_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class DumpOptions:
    """Choices for one dump; the defaults fit an engine the supervisor started."""

    leave_running: bool = False
    tcp_established: bool = False
    network_lock: NetworkLock = NetworkLock.SKIP
    shell_job: bool = False
    verbosity: int = 4
    timeout_s: float = CRIU_TIMEOUT_S
    # Run by CRIU at each dump stage (outside.post_dump_script); not recorded for the restore.
    action_script: Path | None = None

    def shared_flags(self) -> tuple[str, ...]:
        """Flags dump and restore must both be given."""
        tcp = ("--tcp-established", "--network-lock", self.network_lock.value)
        return (
            *COMMON_FLAGS,
            *(tcp if self.tcp_established else ()),
            *(("--shell-job",) if self.shell_job else ()),
        )


@dataclass(frozen=True)
class DumpResult:
    """A finished `criu dump`."""

    image_dir: Path
    log_path: Path
    flags: tuple[str, ...]
    duration_s: float


@dataclass(frozen=True)
class RestoreResult:
    """A finished `criu restore --restore-detached`: the tree runs, re-parented to us."""

    pid: int
    log_path: Path
    duration_s: float


def restore_flags(dump_flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags a restore needs, from the flags the dump was taken with."""
    return tuple(f for f in dump_flags if f not in (*DUMP_ONLY_FLAGS, "--leave-running"))


# Error lines CRIU logs on every run here that are not the cause of anything
# (a VM without CAP_SYS_RESOURCE: "Can't setup RLIMIT_NOFILE for self").
HARMLESS_ERRORS = ("Can't setup RLIMIT_NOFILE",)


def first_error(log_path: Path) -> str | None:
    """The first `Error` line of a CRIU log: usually the cause; later ones are fallout."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if "Error" in line and not any(h in line for h in HARMLESS_ERRORS):
                    return line.strip()
    except OSError:
        return None
    return None


class CriuBackend:
    """Dumps and restores process trees with one CRIU binary.

    Example::

        criu = CriuBackend(locate())
        criu.dump(pid, image_dir, log_dir / "dump.log", DumpOptions(leave_running=True))
        r = criu.restore(image_dir, log_dir / "restore.log", flags=("--ext-unix-sk",))
        r.pid
    """

    def __init__(self, binary: CriuBinary, runner: Runner = run, *,
                 restore_verbosity: int = RESTORE_VERBOSITY) -> None:
        self.binary = binary
        self._run = runner
        self.restore_verbosity = restore_verbosity

    @property
    def version(self) -> str:
        return self.binary.version

    def check(self) -> CommandResult:
        """`criu check`: whether this kernel supports what CRIU needs (not raising)."""
        return self._run([str(self.binary.path), "check"], timeout_s=60, check=False)

    def dump(self, pid: int, image_dir: Path, log_path: Path, opts: DumpOptions) -> DumpResult:
        flags = (*opts.shared_flags(), *DUMP_ONLY_FLAGS)
        if opts.leave_running:
            flags += ("--leave-running",)
        argv = [
            str(self.binary.path), "dump", "-t", str(pid), "-D", str(image_dir),
            f"-v{opts.verbosity}", "-o", str(log_path), *flags,
        ]  # fmt: skip
        if opts.action_script is not None:
            argv += ["--action-script", str(opts.action_script)]
        start = time.monotonic()
        self._call(argv, log_path, opts.timeout_s, f"criu dump of PID {pid}")
        return DumpResult(image_dir, log_path, flags, time.monotonic() - start)

    def restore(
        self,
        image_dir: Path,
        log_path: Path,
        *,
        flags: tuple[str, ...] = COMMON_FLAGS,
        inherit_fds: Mapping[int, str] | None = None,
        timeout_s: float = CRIU_TIMEOUT_S,
        leave_stopped: bool = False,
    ) -> RestoreResult:
        """Restore detached, as a child of the calling thread, which must outlive the tree
        (`proc.in_parent_thread`); `inherit_fds` maps an fd of ours (passed to CRIU) to the
        `pipe:[INODE]` it stands in for. Returns the restored root's PID (from a pidfile).
        `leave_stopped`: CRIU sends each restored process SIGSTOP before it lets go of it,
        so the tree waits, having run none of its own code, until someone sends SIGCONT.
        CRIU logs at `restore_verbosity` (snapshots.restore_log_level)."""
        pidfile = log_path.with_name(log_path.name + ".pid")
        pidfile.unlink(missing_ok=True)
        inherit = inherit_fds or {}
        # --restore-sibling makes the restored root our child, not CRIU's: CRIU restores
        # the root's PR_SET_PDEATHSIG (the engine dies with the agent), and with CRIU as
        # its parent that signal would fire the moment CRIU exits (CRIU warns "Root task
        # has pdeath_sig configured"). As our child it fires when the calling thread exits.
        argv = [
            str(self.binary.path), "restore", "-D", str(image_dir), "--restore-detached",
            "--restore-sibling", "--pidfile", str(pidfile), f"-v{self.restore_verbosity}", "-o",
            str(log_path), *flags,
        ]  # fmt: skip
        for fd, what in inherit.items():
            argv += ["--inherit-fd", f"fd[{fd}]:{what}"]
        if leave_stopped:
            argv.append("--leave-stopped")
        start = time.monotonic()
        self._call(argv, log_path, timeout_s, f"criu restore of {image_dir}", tuple(inherit))
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise SnapshotError(
                f"criu restore of {image_dir} succeeded but wrote no PID to {pidfile}: {e}"
            ) from e
        finally:
            pidfile.unlink(missing_ok=True)
        return RestoreResult(pid, log_path, time.monotonic() - start)

    def _call(
        self, argv: list[str], log_path: Path, timeout_s: float, what: str,
        pass_fds: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        try:
            self._run(argv, timeout_s=timeout_s, log_path=log_path, pass_fds=pass_fds)
        except CommandError as e:
            cause = first_error(log_path) or "no Error line in the log"
            raise SnapshotError(f"{what} failed: {cause}\n(full log: {log_path})\n{e}") from e
