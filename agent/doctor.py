"""`pitstop doctor`: can this host take and restore snapshots? Each failing item names a fix."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from agent.checks import Check
from agent.config import Config
from agent.errors import SnapshotError

CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40
MIN_FREE_BYTES = 1 << 30


def _criu(config: Config) -> list[Check]:
    from agent.checkpoint.criu import CriuBackend
    from agent.checkpoint.criu_locate import MIN_TEXT, locate

    try:
        binary = locate(config.snapshots.criu)
    except SnapshotError as e:
        return [
            Check("criu", False, True, str(e), f"run `make criu` (or install CRIU >= {MIN_TEXT})"),
            Check("criu check", False, True, "skipped: no usable CRIU"),
        ]
    found = Check("criu", True, True, f"{binary.version} at {binary.path} (from {binary.source})")
    backend = CriuBackend(binary)
    r = backend.check()
    said = (r.stdout + r.stderr).strip().splitlines()
    last = said[-1] if said else f"exit status {r.returncode}"
    if r.ok and "Looks good" in r.stdout + r.stderr:
        return [found, Check("criu check", True, True, last)]
    return [
        found,
        Check("criu check", False, True, last,
              f"run `{binary.path} check` as root and fix what it names (kernel config)"),
    ]  # fmt: skip


def _caps(proc_root: Path) -> Check:
    if os.geteuid() == 0:
        return Check("privileges", True, True, "running as root")
    eff = _effective_caps(proc_root)
    if eff & (1 << CAP_CHECKPOINT_RESTORE) or eff & (1 << CAP_SYS_ADMIN):
        return Check("privileges", True, True, "CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN held")
    return Check(
        "privileges", False, True, f"uid {os.geteuid()} without CAP_CHECKPOINT_RESTORE",
        "run the agent as root (the systemd unit does), or grant "
        "AmbientCapabilities=CAP_CHECKPOINT_RESTORE CAP_SYS_PTRACE",
    )  # fmt: skip


def _effective_caps(proc_root: Path) -> int:
    for line in (proc_root / "self" / "status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _amx(proc_root: Path) -> Check:
    from agent.checkpoint.xcomp import cpu_has_amx

    if not cpu_has_amx(proc_root):
        return Check("amx", True, False, "this CPU has no AMX: a restore has no AMX "
                     "permission to give back")  # fmt: skip
    detail = ("this CPU has AMX; CRIU does not restore a process's AMX permission, so "
              "each restore asks for it again in every restored process (ptrace)")  # fmt: skip
    if os.geteuid() == 0 or _effective_caps(proc_root) & (1 << CAP_SYS_PTRACE):
        return Check("amx", True, True, detail)
    return Check(
        "amx", False, True, f"{detail}, which needs CAP_SYS_PTRACE; without it a restored "
        "engine that uses AMX (torch bf16 on the CPU) dies with SIGILL",
        "run the agent as root (the systemd unit does), or grant "
        "AmbientCapabilities=CAP_SYS_PTRACE",
    )  # fmt: skip


def _io_uring(config: Config, proc_root: Path) -> Check:
    # CRIU cannot dump an io_uring instance, and vLLM's API server makes one (vLLM's
    # snapshot docs name the same need).
    needed = config.engine.kind == "vllm"
    path = proc_root / "sys" / "kernel" / "io_uring_disabled"
    try:
        value = path.read_text().strip()
    except OSError:
        return Check("io_uring", not needed, needed, f"{path} is absent (kernel < 6.6)",
                     None if not needed else "use a kernel >= 6.6 for vLLM snapshots")  # fmt: skip
    if value == "2":
        return Check("io_uring", True, needed, "kernel.io_uring_disabled = 2")
    return Check(
        "io_uring", False, needed, f"kernel.io_uring_disabled = {value}: engines may create "
        "io_uring instances, which CRIU cannot dump",
        "sysctl -w kernel.io_uring_disabled=2 (and persist it in /etc/sysctl.d/)",
    )  # fmt: skip


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode for anonymous memory (always, madvise,
    never; "unknown" when unreadable as such), or None where the file is absent."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "unknown")


def _thp(path: Path) -> Check:
    # CRIU restores an image into fresh anonymous memory; with 4 KiB pages most of that time
    # is page faults. A warning: restores work either way.
    mode = thp_mode(path)
    if mode is None:
        return Check("transparent huge pages", True, False, f"{path} is absent: no THP here")
    if mode == "always":
        return Check("transparent huge pages", True, False, "always")
    return Check(
        "transparent huge pages", False, False, f"{mode}: CRIU restores the engine's pages "
        "into 4 KiB pages, measured 35-70 % slower than with `always` (docs/performance.md)",
        f"echo always > {path}, and at every boot: the kernel role's "
        "kernel_transparent_hugepage (or a tmpfiles.d line: "
        f"w {path} - - - - always)",
    )  # fmt: skip


def fs_type(path: Path, mountinfo: Path) -> str | None:
    """The file system type of the mount that holds `path` (from a mountinfo file), or
    None when it cannot be read."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target, best, kind = str(path).rstrip("/") + "/", "", None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        point = fields[4].rstrip("/") + "/"
        # The longest mount point above `path` holds it; of two at one point, the later.
        if target.startswith(point) and len(point) >= len(best):
            best, kind = point, tail.split()[0]
    return kind


KDAT = "criu.kdat"


def _criu_cache(run_dir: Path, mountinfo: Path) -> Check:
    # CRIU probes the kernel at the start of every dump and restore unless it finds the
    # probe's result in /run/criu.kdat, which it keeps only on a tmpfs (criu/kerndat.c); a
    # leftover criu.kdat.tmp makes its next save fail. 10-40 ms a run (docs/performance.md).
    name = "criu kernel cache"
    kind = fs_type(run_dir, mountinfo)
    if kind is None:
        return Check(name, True, False, f"cannot read {mountinfo}: unknown")
    if kind != "tmpfs":
        return Check(
            name, False, False, f"{run_dir} is {kind}, not a tmpfs: CRIU keeps its kernel probe "
            f"({run_dir / KDAT}) only on a tmpfs, so every dump and restore probes the kernel "
            "again (10-40 ms each)",
            f"mount a tmpfs on {run_dir} (systemd does; in a container: --tmpfs {run_dir})",
        )  # fmt: skip
    stale = run_dir / f"{KDAT}.tmp"
    if stale.exists() and not (run_dir / KDAT).exists():
        return Check(name, False, False, f"{stale} is left from a CRIU that did not finish "
                     "saving its kernel probe: no CRIU can save it while it is there",
                     f"rm {stale}")  # fmt: skip
    return Check(name, True, False, f"{run_dir} is a tmpfs")


def _gpu() -> tuple[bool, Check]:
    """(whether a GPU is present, the persistence mode check)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means: no usable GPU here
        return False, Check("persistence mode", True, False, "no NVIDIA GPU or driver: CPU only")
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        on = pynvml.nvmlDeviceGetPersistenceMode(h) == pynvml.NVML_FEATURE_ENABLED
    finally:
        pynvml.nvmlShutdown()
    if on:
        return True, Check("persistence mode", True, True, "enabled on GPU 0")
    return True, Check(
        "persistence mode", False, True, "disabled on GPU 0: the driver state is torn down "
        "between processes", "nvidia-smi -pm 1 (or enable nvidia-persistenced)",
    )  # fmt: skip


def _cuda(gpu: bool) -> Check:
    from agent.checkpoint.cuda import CudaCheckpoint

    a = CudaCheckpoint().available()
    if a.ok:
        return Check("cuda checkpoint", True, gpu, a.reason)
    if not gpu:
        return Check("cuda checkpoint", True, False, f"not needed without a GPU ({a.reason})")
    return Check("cuda checkpoint", False, True, a.reason,
                 "pip install 'pitstop[cuda]' and use an NVIDIA driver >= 570")  # fmt: skip


def _space(config: Config, min_free: int) -> Check:
    where = config.paths.snapshots
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{free / 2**30:.1f} GiB free at {probe} (snapshots go to {where})"
    if free >= min_free:
        return Check("free space", True, True, detail)
    return Check("free space", False, True, detail,
                 f"free at least {min_free / 2**30:.0f} GiB there, or set paths.snapshot_dir "
                 "to a larger file system; `pitstop snapshot delete` removes old ones")  # fmt: skip


def run_checks(
    config: Config,
    *,
    proc_root: Path = Path("/proc"),
    gpu_probe: Callable[[], tuple[bool, Check]] = _gpu,
    min_free: int = MIN_FREE_BYTES,
    thp_path: Path = THP_ENABLED,
    run_dir: Path = Path("/run"),
) -> list[Check]:
    """Every doctor item, in the order a user fixes them.

    Example::

        bad = [c for c in run_checks(load_config(None)) if c.needed and not c.ok]
    """
    gpu, persistence = gpu_probe()
    checks = [
        *_criu(config),
        _caps(proc_root),
        _amx(proc_root),
        _io_uring(config, proc_root),
        _thp(thp_path),
        _criu_cache(run_dir, proc_root / "self" / "mountinfo"),
        _cuda(gpu),
        persistence,
        _space(config, min_free),
    ]
    if config.engine.kind == "vllm":
        from agent.engines.vllm.doctor import vllm_checks

        checks += vllm_checks(config)
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.needed else "warn")
        lines.append(f"{mark}  {c.name:<17} {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"      {'':<17} fix: {c.fix}")
    return "\n".join(lines)
