"""What a running engine tree would put in a CRIU image: its private memory, mapping by mapping.

CRIU dumps a process's anonymous and private-dirty pages (file pages it can read back from
the file are left out), so the image of an idle engine is about the sum of `Anonymous` and
`Private_Dirty` over its mappings. This reads /proc/PID/smaps of every process under the
given root (the agent's `engine_pid`) and prints, per process and for the tree, the biggest
mappings grouped by what they map (a file, [heap], an anonymous range), to say where the
image's bytes come from before one is taken:

    python3 bench/smaps_anatomy.py PID [--top 25] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.checkpoint.xcomp import process_tree  # noqa: E402

BIG_KIB = 64 << 10


def private_kib(smaps: str) -> dict[str, int]:
    """{mapping name: KiB CRIU would dump} for one process's smaps text."""
    out: dict[str, int] = defaultdict(int)
    name, anon, dirty, start = "", 0, 0, ""

    def flush() -> None:
        kib = max(anon, dirty)
        # A big anonymous mapping on its own line (a pool, an arena): small ones summed.
        key = name or (f"[anonymous at {start}]" if kib >= BIG_KIB else "[anonymous]")
        if kib:
            out[key] += kib

    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line
            flush()
            parts = line.split(maxsplit=5)
            name, anon, dirty = (parts[5].strip() if len(parts) == 6 else ""), 0, 0
            start = head.split("-")[0]
        elif head == "Anonymous:":
            anon = int(line.split()[1])
        elif head == "Private_Dirty:":
            dirty = int(line.split()[1])
    flush()
    return dict(out)


def anatomy(root: int, proc: Path = Path("/proc")) -> dict:
    tree: dict[str, dict] = {}
    total: dict[str, int] = defaultdict(int)
    for pid in process_tree(root, proc):
        try:
            comm = (proc / str(pid) / "comm").read_text().strip()
            kib = private_kib((proc / str(pid) / "smaps").read_text())
        except OSError:
            continue
        tree[str(pid)] = {"comm": comm, "private_mib": round(sum(kib.values()) / 1024, 1),
                          "by_mapping_kib": kib}
        for k, v in kib.items():
            total[k] += v
    return {"root": root, "processes": tree,
            "private_mib": round(sum(total.values()) / 1024, 1), "by_mapping_kib": dict(total)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pid", type=int)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    got = anatomy(a.pid)
    for pid, p in got["processes"].items():
        print(f"{pid} {p['comm']}: {p['private_mib']} MiB private")
    print(f"tree: {got['private_mib']} MiB private; the biggest mappings:")
    for name, kib in sorted(got["by_mapping_kib"].items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {kib / 1024:10.1f} MiB  {name}")
    if a.json:
        a.json.write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
