"""What the drift watcher and a restart pay: weights digest cold, cached and --rehash, and
host_identity with its caches warm. Not run by `make test`.

    .venv/bin/python bench/identity_cost.py [MODEL_DIR] [--gib N]

MODEL_DIR defaults to a fresh `pitstop make-model` tiny model; --gib N adds a model of one
N-GiB random safetensors file. "cold" is the first digest (no cache file); with
--drop-caches (root; it slows every other user of the host) the page cache is dropped
before it too, so the figure includes reading the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.config import parse_config  # noqa: E402
from agent.engines import build_adapter  # noqa: E402
from agent.identity import host_identity  # noqa: E402
from agent.modelgen import make_model, spec_for  # noqa: E402
from agent.weights import CACHE_NAME, WeightsDigester  # noqa: E402

DROP = False


def drop_caches() -> str:
    if not DROP:
        return "page cache warm"
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped"
    except OSError:
        return "warm page cache"


def measure(model: Path, state: Path, label: str) -> None:
    # racy_ns=0: the files were just written; a real model is older than the 2 s guard.
    cache = state / f"{model.name}-{CACHE_NAME}"
    with contextlib.suppress(FileNotFoundError):
        cache.unlink()
    how = drop_caches()
    cold = WeightsDigester(cache, racy_ns=0).digest(model)
    cached = WeightsDigester(cache, racy_ns=0).digest(model)
    how_re = drop_caches()
    rehash = WeightsDigester(cache, racy_ns=0).digest(model, rehash=True)
    mib = cold.bytes_read / 2**20
    print(f"{label}: {len(cold.files)} files, {mib:.1f} MiB")
    print(f"  cold   ({how}): {cold.seconds * 1e3:9.1f} ms, {cold.bytes_read} bytes read, "
          f"{mib / max(cold.seconds, 1e-9):.0f} MiB/s")
    print(f"  cached (new digester, cache file): {cached.seconds * 1e3:9.2f} ms, "
          f"{cached.bytes_read} bytes read")
    print(f"  --rehash ({how_re}): {rehash.seconds * 1e3:9.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", type=Path)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--drop-caches", action="store_true")
    a = p.parse_args()
    global DROP
    DROP = a.drop_caches
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-") as tmp:
        t = Path(tmp)
        model = a.model or t / "tiny"
        if a.model is None:
            make_model(model, spec_for("tiny"))
        measure(model, t, f"model {model}")
        if a.gib > 0:
            big = t / "big"
            big.mkdir()
            with open(big / "model.safetensors", "wb") as f:
                for _ in range(int(a.gib * 64)):
                    f.write(os.urandom(16 << 20))
            (big / "config.json").write_text("{}\n")
            measure(big, t, f"one {a.gib:g} GiB file")

        cfg = parse_config({"engine": {"model": str(model), "device": "cpu"}}, "bench")
        adapter = build_adapter(cfg)
        t0 = time.perf_counter()
        host_identity(cfg, adapter, "4.1.1", None)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = 20
        for _ in range(n):
            host_identity(cfg, adapter, "4.1.1", None)
        warm = (time.perf_counter() - t0) / n
        print(f"host_identity: first {first * 1e3:.1f} ms (engine interpreter probe), "
              f"then {warm * 1e3:.2f} ms each (NVML absent here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
