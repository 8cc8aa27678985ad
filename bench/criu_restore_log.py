"""Where a CRIU restore's time went, read from its debug log (`-v4`, every line timestamped).

    python3 bench/criu_restore_log.py LOG [LOG ...] [--json]

A restore's largest part is each process's restorer reading the image's pages into place:
one or more `preadv` calls, each of many iovecs (one per run of pages the image holds), which
fault in the memory they write. Per process this says the pages CRIU restored, the iovecs
it read them with, the bytes and the seconds of those reads (from each `Preadv` line to its
"`- returned" line), the mappings and threads it restored; and for the whole restore, the
seconds to "Restore finished successfully" and to the log's last line. Two restores of the
same bytes that take different times differ here: in the reads' seconds (the memory they
fault in: `pitstop snapshot memory` counts its runs and 2 MiB windows), in the mappings and
threads, or elsewhere (the rest of the restore).

Pitstop keeps such a log of every restore when `snapshots.restore_log_level` is 4
(`<state>/run/criu/<snapshot>-restore-<ms>.log`); `bench/vllm_gpu_bench.py --debug-restore`
takes one hybrid restore so and puts this summary in the hybrid row's `debug_restore`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

_LINE = re.compile(r"^\((\d+)\.(\d+)\)\s+(.*)$")
_PREADV = re.compile(r"^pie: (\d+): Preadv 0x[0-9a-f]+:\d+\.\.\. \((\d+) iovs\)")
_RETURNED = re.compile(r"^pie: (\d+): `- returned (-?\d+)")
_STAT = re.compile(r"^(\d+): (nr_restored_pages|nr_enqueued):\s+(\d+)")
# Each process's restorer logs every mapping it moves into place, and CRIU each thread's stack.
_VMA = re.compile(r"^pie: (\d+):\s+mmap\(0x[0-9a-f]+ -> 0x[0-9a-f]+,")
_THREAD = re.compile(r"^(\d+): Thread\s+\d+ stack")
_FINISHED = "Restore finished successfully"


@dataclass
class ProcessRead:
    """One process's page reads in a restore."""

    pid: int
    pages: int = 0        # nr_restored_pages
    enqueued: int = 0     # nr_enqueued: the runs queued for the restorer's reads
    iovs: int = 0         # the iovecs of its preadv calls
    bytes: int = 0        # what those calls returned
    read_s: float = 0.0   # their seconds, summed
    calls: int = 0
    vmas: int = 0         # the mappings CRIU restored (each mapped, then moved into place)
    threads: int = 0


@dataclass
class RestoreLog:
    """One restore's log, summed up."""

    path: str
    finished_s: float | None   # to "Restore finished successfully" (None: it did not)
    last_s: float | None       # to the log's last timestamped line
    processes: list[ProcessRead] = field(default_factory=list)

    @property
    def read_s_max(self) -> float:
        """The longest process's reads: the restorers read in parallel."""
        return max((p.read_s for p in self.processes), default=0.0)


def read_log(path: Path) -> RestoreLog:
    """The summary of one CRIU restore log; a log without timestamps (a level below 4)
    is refused by name, as it cannot say where the time went."""
    procs: dict[int, ProcessRead] = {}
    open_reads: dict[int, float] = {}
    finished = last = None

    def of(pid: str) -> ProcessRead:
        return procs.setdefault(int(pid), ProcessRead(int(pid)))

    for raw in path.read_text(errors="replace").splitlines():
        m = _LINE.match(raw)
        if m is None:
            continue
        t = int(m.group(1)) + int(m.group(2)) / 10 ** len(m.group(2))
        last, text = t, m.group(3)
        if (p := _PREADV.match(text)) is not None:
            proc = of(p.group(1))
            proc.iovs += int(p.group(2))
            proc.calls += 1
            open_reads[proc.pid] = t
        elif (r := _RETURNED.match(text)) is not None and int(r.group(1)) in open_reads:
            proc = of(r.group(1))
            proc.read_s += t - open_reads.pop(proc.pid)
            proc.bytes += max(int(r.group(2)), 0)
        elif (s := _STAT.match(text)) is not None:
            setattr(of(s.group(1)), "pages" if s.group(2) == "nr_restored_pages" else "enqueued",
                    int(s.group(3)))
        elif (v := _VMA.match(text)) is not None:
            of(v.group(1)).vmas += 1
        elif (th := _THREAD.match(text)) is not None:
            of(th.group(1)).threads += 1
        elif text.startswith(_FINISHED):
            finished = t
    if last is None:
        raise ValueError(f"{path}: no timestamped line: it is not CRIU's debug log (-v4; "
                         "snapshots.restore_log_level 4 keeps one of each restore)")
    for proc in procs.values():
        proc.read_s = round(proc.read_s, 6)
    return RestoreLog(str(path), finished, last,
                      sorted(procs.values(), key=lambda p: (-p.bytes, p.pid)))


def as_json(log: RestoreLog) -> dict:
    return {"path": log.path, "finished_s": log.finished_s, "last_s": log.last_s,
            "read_s_max": round(log.read_s_max, 6),
            "processes": [asdict(p) for p in log.processes]}


def as_text(log: RestoreLog) -> str:
    lines = [f"{log.path}: finished at {log.finished_s} s, last line at {log.last_s} s; "
             f"longest process's reads {log.read_s_max:.3f} s",
             f"{'PID':>8}  {'PAGES':>9}  {'QUEUED':>7}  {'IOVS':>7}  {'MB READ':>9}  "
             f"{'READ S':>7}  {'CALLS':>5}  {'VMAS':>6}  THREADS"]
    lines += [f"{p.pid:>8}  {p.pages:>9}  {p.enqueued:>7}  {p.iovs:>7}  {p.bytes / 1e6:>9.1f}  "
              f"{p.read_s:>7.3f}  {p.calls:>5}  {p.vmas:>6}  {p.threads}"
              for p in log.processes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", type=Path, nargs="+")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        logs = [read_log(p) for p in a.logs]
    except (OSError, ValueError) as e:
        print(f"criu_restore_log: {e}", file=sys.stderr)
        return 1
    print(json.dumps([as_json(x) for x in logs], indent=1) if a.json
          else "\n\n".join(as_text(x) for x in logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
