"""How fast the refill recipe of a vLLM-style held region is made, on this machine's CPU.

The agent makes a recipe after a vLLM engine's first start over the holder (agent/holder/
recipe.py): the held region read once and hashed, each checkpoint tensor found in the
parameter it went to, the region rebuilt from the files and hashed again. The first hybrid
snapshot waits for it, so its rate bounds how soon a node seeds the fleet. This bench makes a
Llama-shaped checkpoint of --gib GiB (`pitstop make-model`), lays its tensors out as vLLM binds
them (q/k/v fused into qkv_proj, gate/up into gate_up_proj, 256-byte aligned, back to back),
and times `recipe_of` plus the check, reading the region from memory (no holder, no GPU).

    python3 bench/recipe_bench.py bench/results --gib 2 --runs 3

Writes OUT/recipe-cpu.json with `rows` (engine "holder", path "recipe").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.holder.paramlayout import ParamLayout, ParamSlot  # noqa: E402
from agent.holder.recipe import check, checkpoint_tensors, recipe_of  # noqa: E402

ALIGN = 256
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def vllm_region(model: Path) -> tuple[ParamLayout, bytearray]:
    """The model's tensors as vLLM's parameters, laid out back to back in one region."""
    params: dict[str, list[tuple[int, bytes]]] = {}
    for t in checkpoint_tensors(model):
        with (model / t.file).open("rb") as f:
            raw = os.pread(f.fileno(), t.size, t.at)
        head, _, leaf = t.name.rpartition(".")
        path, _, mod = head.rpartition(".")
        fused, order = FUSED.get(mod, (mod, 0))
        params.setdefault(f"{path}.{fused}.{leaf}", []).append((order, raw))
    region, slots = bytearray(), []
    for name in sorted(params):
        region += bytes(-len(region) % ALIGN)
        data = b"".join(raw for _, raw in sorted(params[name], key=lambda p: p[0]))
        slots.append(ParamSlot(name, len(region), len(data)))
        region += data
    region += bytes(-len(region) % ALIGN)
    return ParamLayout("bench/vllm-params", len(region), tuple(slots)), region


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/pitstop-models"))
    a = ap.parse_args()
    model = a.models / f"recipe-{a.gib:g}"
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(model), "--target-gib",
                    str(a.gib)], cwd=REPO, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": "cpu"})
    layout, region = vllm_region(model)
    tensors = checkpoint_tensors(model)
    piece = 16 << 20
    runs, make_s, check_s = [], [], []
    for _ in range(a.runs):
        view = memoryview(region)
        t0 = time.monotonic()
        made, placed = recipe_of(layout, len(region),
                                 iter(view[k:k + piece] for k in range(0, len(region), piece)),
                                 model, tensors)
        t1 = time.monotonic()
        refused = check(made, model)
        t2 = time.monotonic()
        if refused is not None or len(placed) != len(tensors):
            raise SystemExit(f"the recipe does not rebuild the region: {refused}")
        runs.append(round(t2 - t0, 3))
        make_s.append(round(t1 - t0, 3))
        check_s.append(round(t2 - t1, 3))
    gb = len(region) / 1e9
    command = " ".join(["python3", "bench/recipe_bench.py", *sys.argv[1:]])
    row = {"engine": "holder", "path": "recipe", "gib": a.gib, "runs_s": runs,
           "median_s": statistics.median(runs), "machine": f"cpu-{os.cpu_count()}core",
           "command": command, "region_bytes": len(region), "parameters": len(layout.slots),
           "find_and_hash_s": make_s, "rebuild_check_s": check_s,
           "gb_per_s": round(gb / statistics.median(runs), 3)}
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / "recipe-cpu.json"
    out.write_text(json.dumps({"rows": [row]}, indent=1) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
