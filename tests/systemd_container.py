"""A real systemd, booted in a systemd-nspawn container, for tests that drive units."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Inside the container commands get a clean environment: the host's (pytest's, CI's, pyenv's)
# variables mean nothing there and would leak into the units we start.
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ContainerError(RuntimeError):
    """The container did not boot, or a command in it failed; the message carries its output."""


@dataclass(frozen=True)
class Bind:
    """One host directory made visible in the container (at the same path unless `target`)."""

    path: Path
    writable: bool = False
    target: Path | None = None

    def flag(self) -> str:
        spec = f"{self.path}:{self.target}" if self.target else str(self.path)
        return f"--bind={spec}" if self.writable else f"--bind-ro={spec}"


@dataclass
class SystemdContainer:
    """A booted Debian rootfs whose PID 1 is systemd; commands enter it with nsenter.

    The rootfs is never written: `--volatile=overlay` puts a tmpfs overlay over it that dies
    with the container. The container has its own network namespace with loopback only, so
    ports used inside it cannot collide with anything on the host.

    Example::

        with SystemdContainer(Path(".cache/rootfs/bookworm"), [Bind(repo)], log) as c:
            c.systemctl("start", "pitstop-agent.service")
            print(c.show("pitstop-agent.service", "MainPID")["MainPID"])
    """

    rootfs: Path
    binds: Sequence[Bind]
    log_path: Path
    boot_timeout_s: float = 120.0
    name: str = field(default_factory=lambda: f"pitstop-test-{uuid.uuid4().hex[:8]}")
    # Set for every unit (systemd's DefaultEnvironment) and every command run in it.
    env: dict[str, str] = field(default_factory=dict)
    _nspawn: subprocess.Popen[bytes] | None = None
    _log: object | None = None
    _cgroups: list[Path] = field(default_factory=list)
    leader_pid: int | None = None

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        argv = [
            "systemd-nspawn",
            # No host systemd-machined / D-Bus to register with: both flags
            # are required on these machines, without them nspawn refuses to start.
            "--register=no",
            "--keep-unit",
            f"--machine={self.name}",
            "-D",
            str(self.rootfs),
            # A tmpfs overlay over the read-only cached tree: tests never dirty it and
            # nothing needs copying (--ephemeral would copy the whole directory on ext4).
            "--volatile=overlay",
            "--private-network",
            # What the agent unit keeps and nspawn leaves out of its default set: CRIU's own
            # capability, and CAP_SYS_TIME, which a restore needs to set the offsets of the time
            # namespace it restores into (the engine's monotonic clock goes on unbroken).
            "--capability=CAP_CHECKPOINT_RESTORE,CAP_NET_ADMIN,CAP_IPC_LOCK,CAP_SYS_TIME",
            "--console=read-only",
            *(b.flag() for b in self.binds),
            "--boot",
            # PID 1 reads the host's /proc/cmdline, whose "quiet" would lower its log level to
            # notice; at info the journal names every process systemd kills.
            "systemd.log_level=info",
            *(f"systemd.setenv={k}={v}" for k, v in self.env.items()),
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the container
        # With --keep-unit the container's cgroup tree is rooted at nspawn's own cgroup. This
        # host has no systemd, so that is the root cgroup, shared by every container on the
        # machine: two containers would both manage /system.slice/pitstop-agent.service, see
        # each other's processes there as PID 0 (not in their PID namespace), and systemd's
        # kill of that cgroup would fail with EIO. So nspawn starts in a cgroup of its own.
        self._cgroups = _private_cgroups(self.name)
        enter = "".join(f'mkdir -p {shlex.quote(str(d))} && echo $$ > '
                        f'{shlex.quote(str(d / "cgroup.procs"))} && ' for d in self._cgroups)
        self._nspawn = subprocess.Popen(
            ["sh", "-c", f'{enter}exec "$@"', "sh", *argv],
            # nspawn puts the whole container under its own seccomp filter. A process under
            # seccomp cannot suspend another's (PTRACE_O_SUSPEND_SECCOMP), so CRIU in any unit
            # of the container could not dump anything. Without it, the only filters in the
            # container are the ones the units under test ask for, as on a real host.
            # The unified cgroup hierarchy (cgroup v2 only), as on a Debian 12 host, even though
            # this machine's own hierarchy is hybrid.
            env={**os.environ, "SYSTEMD_SECCOMP": "0", "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C aimed at pytest must not halt the container mid-test;
            # teardown does that in order.
            start_new_session=True,
        )
        try:
            self.leader_pid = self._wait_for_leader()
            self._wait_until_running()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        """Power the container off; kill it when it does not go in time. Leaves nothing."""
        proc, self._nspawn = self._nspawn, None
        if proc is not None and proc.poll() is None:
            # nspawn turns the first SIGTERM into an orderly poweroff of the container.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                # Killing the container's PID 1 takes its whole PID namespace with it.
                if self.leader_pid is not None:
                    _kill_quietly(self.leader_pid)
                proc.wait(10)
        for d in reversed(self._cgroups):
            _remove_cgroup(d)
        self._cgroups = []
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def __enter__(self) -> SystemdContainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_for_leader(self) -> int:
        """The host PID of the container's systemd: a descendant of nspawn named systemd."""
        assert self._nspawn is not None
        deadline = time.monotonic() + self.boot_timeout_s
        while time.monotonic() < deadline:
            if self._nspawn.poll() is not None:
                raise ContainerError(
                    f"systemd-nspawn exited with {self._nspawn.returncode} before booting; "
                    f"its output:\n{self.boot_log()}"
                )
            for pid in _descendants(self._nspawn.pid):
                if _comm(pid) == "systemd":
                    return pid
            time.sleep(0.05)
        raise ContainerError(f"no systemd in container {self.name} after {self.boot_timeout_s} s")

    def _wait_until_running(self) -> None:
        deadline = time.monotonic() + self.boot_timeout_s
        state = ""
        while time.monotonic() < deadline:
            r = self.run(["systemctl", "is-system-running"], check=False, timeout=30)
            state = r.stdout.strip()
            # "degraded" still means boot is over: a unit of the minimal rootfs failed, which
            # is the test's business to look at, not a reason to give up on the container.
            if state in ("running", "degraded"):
                return
            time.sleep(0.1)
        raise ContainerError(
            f"container {self.name} still '{state}' after {self.boot_timeout_s} s; "
            f"boot log:\n{self.boot_log()}"
        )

    # -- commands -----------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 120.0,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv in every namespace of the container, as root, with a clean environment."""
        if self.leader_pid is None:
            raise ContainerError("the container is not started")
        envs = [f"{k}={v}" for k, v in
                {"PATH": CONTAINER_PATH, **self.env, **(env or {})}.items()]
        full = ["nsenter", "-t", str(self.leader_pid), "-a", "-r", "-w",
                "env", "-i", *envs, *argv]
        r = subprocess.run(
            full, input=input, capture_output=True, text=True, timeout=timeout,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and r.returncode != 0:
            raise ContainerError(
                f"in container {self.name}: {shlex.join(argv)} exited with {r.returncode}\n"
                f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
            )
        return r

    def sh(self, script: str, check: bool = True,
           timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run a shell script in the container (bash, fail on first error)."""
        return self.run(["bash", "-euo", "pipefail", "-c", script], check=check, timeout=timeout)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 120.0) -> str:
        return self.run(["systemctl", *args], check=check, timeout=timeout).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show` as a dict, e.g. show(u, "ActiveState", "MainPID", "NRestarts")."""
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, since_cursor: str | None = None) -> str:
        """The unit's journal as plain text (messages of systemd about it and its own output)."""
        argv = ["journalctl", "--no-pager", "-o", "short-monotonic", "-u", unit]
        if since_cursor:
            argv += ["--after-cursor", since_cursor]
        return self.run(argv, check=False).stdout

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        self.run(["bash", "-c", f'mkdir -p "$(dirname {shlex.quote(path)})" '
                 f"&& cat > {shlex.quote(path)} && chmod {mode:o} {shlex.quote(path)}"],
                 input=text)

    def wait_for(
        self, what: str, predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1
    ) -> float:
        """Poll until predicate() holds; return the seconds it took. Fails naming `what`."""
        start = time.monotonic()
        while True:
            if predicate():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise ContainerError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(interval_s)

    def boot_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return "(no boot log)"


def python_binds(executable: str = sys.executable) -> list[Bind]:
    """The host directories the repo's venv needs to run in the container, read-only.

    A venv's python is a symlink to a base interpreter (pyenv's, here under /root/.pyenv);
    the container gets that base installation at the same path so the venv's own entry points
    (`.venv/bin/pitstop`) run unchanged inside.
    """
    base = Path(sys.base_prefix).resolve()
    if base == Path("/usr") or Path("/usr") in base.parents:
        raise ContainerError(
            f"the venv's base Python lives under /usr ({base}); binding it would hide the "
            "container's own /usr. Make the venv from a Python outside /usr (pyenv) instead."
        )
    real = Path(os.path.realpath(executable))
    binds = [Bind(base)]
    if base not in real.parents and real.parent != base:
        binds.append(Bind(real.parent))
    return binds


def _private_cgroups(name: str) -> list[Path]:
    """A cgroup `name` below our own, in cgroup v2 and in v1's name=systemd hierarchy.

    Those are the hierarchies nspawn and the container's systemd use; on a pure cgroup v2
    host the list has one entry.
    """
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    dirs = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        mount, fstype, options = Path(fields[4]), fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2" and "" in own:
            dirs.append(mount / own[""].lstrip("/") / name)
        elif fstype == "cgroup" and "name=systemd" in options and "name=systemd" in own:
            dirs.append(mount / own["name=systemd"].lstrip("/") / name)
    return dirs


def _remove_cgroup(top: Path) -> None:
    """Kill whatever is left below `top` (nothing, normally), then remove the whole subtree."""
    if not top.exists():
        return
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            for pid in procs.read_text().split():
                _kill_quietly(int(pid))
    deadline = time.monotonic() + 10
    while top.exists() and time.monotonic() < deadline:
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
        if top.exists():
            time.sleep(0.1)


def _descendants(pid: int) -> Iterable[int]:
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for c in children:
            stack.append(int(c))
            yield int(c)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


REPO = Path(__file__).resolve().parent.parent
ROOTFS = REPO / ".cache" / "rootfs" / "bookworm"
# Where a test's own scratch directory appears in the container: outside /tmp, because the
# units' PrivateTmp= would hide /tmp paths from the services under test.
SCRATCH = Path("/srv/pitstop-test")


def container_prerequisites(rootfs: Path = ROOTFS) -> list[str]:
    """What is missing to boot a test container here (empty when nothing is)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (systemd-nspawn and nsenter need it)")
    for tool in ("systemd-nspawn", "nsenter"):
        if not any(os.access(Path(d) / tool, os.X_OK)
                   for d in os.environ.get("PATH", "").split(os.pathsep)):
            missing.append(f"{tool} (`make rootfs` installs systemd-container)")
    if not (rootfs / ".pitstop-rootfs").exists():
        missing.append(f"the rootfs {rootfs} (`make rootfs` makes it)")
    return missing


def cache_link_binds(rootfs: Path, cache: Path = REPO / ".cache") -> list[Bind]:
    """The targets of `.cache` entries that link out of the repo (a git worktree shares the
    main checkout's CRIU and models this way, entry by entry or as a whole `.cache` link),
    read-only at their own paths: through the repo's bind alone the container would see
    dangling links. Not the one holding `rootfs`, the container's own root."""
    binds = []
    root = rootfs.resolve()
    linked = cache.is_symlink() and REPO not in cache.resolve().parents
    for entry in sorted(cache.iterdir()) if cache.is_dir() else []:
        real = entry.resolve()
        if (linked or entry.is_symlink()) and REPO not in real.parents and real.is_dir() \
                and real != root and real not in root.parents:
            binds.append(Bind(real))
    return binds


def venv_link_binds(repo: Path = REPO) -> tuple[list[Bind], dict[str, str]]:
    """A git worktree's venvs (`.venv*`) link to the main checkout's, whose editable install
    imports the main checkout's `agent`: their targets, read-only at their own paths, and
    PYTHONPATH so that what runs in the container is this checkout's code. Nothing for a
    checkout with venvs of its own."""
    binds = [Bind(v.resolve()) for v in sorted(repo.glob(".venv*"))
             if v.is_symlink() and repo not in v.resolve().parents and v.resolve().is_dir()]
    return binds, ({"PYTHONPATH": str(repo)} if binds else {})


def make_container(scratch: Path, log_path: Path, rootfs: Path = ROOTFS) -> SystemdContainer:
    """A container with the repo and its venv read-only and `scratch` writable at SCRATCH."""
    venvs, env = venv_link_binds()
    binds = [Bind(REPO), *cache_link_binds(rootfs), *venvs, *python_binds(),
             Bind(scratch, writable=True, target=SCRATCH)]
    return SystemdContainer(rootfs=rootfs, binds=binds, log_path=log_path, env=env)
