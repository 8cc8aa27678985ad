"""`pitstop snapshot memory`: a real CRIU image's page bytes by process and kind of mapping,
adding up to the image's pages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.checkpoint.criu_image import PAGE
from agent.checkpoint.image_memory import HUGE, image_memory, images_in, memory_text
from agent.cli import main
from tests.agentproc import agent_config
from tests.snapshot_helpers import (
    CANARY,
    Counter,
    capture,
    identity,
    snapshotter,
    subreaper,  # noqa: F401 - autouse: this process reaps restored trees
)

pytestmark = pytest.mark.integration

BALLAST_MIB = 24


def test_the_image_of_a_process_is_its_ballast_heap_and_library_pages_and_adds_up(
        tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    snap = snapshotter(state / "snapshots", tmp_path / "logs")
    c = Counter(tmp_path / "c.sock", BALLAST_MIB)
    try:
        assert c.inc() == 1
        info = capture(snap, c.pid, canary=CANARY, identity=identity(snap.criu.version))
    finally:
        c.stop()
    where = images_in(snap.store.path(info.id))
    assert where == snap.store.path(info.id)
    rows = image_memory(where)
    mine = {r.kind: r.bytes for r in rows if r.pid == c.pid}
    # The ballast (os.urandom, one large malloc: its own anonymous mapping) is all there.
    assert mine.get("anonymous", 0) >= BALLAST_MIB << 20, rows
    # The interpreter's written pages of its own binary and libraries are private file pages.
    assert any(k.startswith("file /") for k in mine), rows
    pages = sum(p.stat().st_size for p in where.glob("pages-*.img"))
    assert sum(r.bytes for r in rows) == pages
    assert rows == sorted(rows, key=lambda r: -r.bytes)

    config = tmp_path / "pitstop.yaml"
    config.write_text(yaml.safe_dump(agent_config(tmp_path, tiny_model)))
    assert main(["snapshot", "memory", info.id, "--json", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"pid": r.pid, "kind": r.kind, "bytes": r.bytes, "areas": r.areas, "runs": r.runs,
         "windows_2m": r.windows_2m} for r in rows]
    assert main(["snapshot", "memory", info.id, "--config", str(config)]) == 0
    assert capsys.readouterr().out == memory_text(rows) + "\n"

    # An image cut short is named as damaged, with what to do, and nothing is printed.
    pagemap = where / f"pagemap-{c.pid}.img"
    pagemap.write_bytes(pagemap.read_bytes()[:-3])
    assert main(["snapshot", "memory", info.id, "--config", str(config)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"snapshot {info.id}: its CRIU image is damaged" in err
    assert f"pitstop snapshot delete {info.id}" in err


def test_each_row_says_how_its_pages_lie_runs_and_2mib_windows(tmp_path: Path) -> None:
    """Two images of the same bytes restore in different times when their pages lie
    differently: the rows count the runs a restore reads and the huge-page windows it
    fills, here of two mappings whose written pages are known (tests/workloads/counter.py
    --shapes)."""
    snap = snapshotter(tmp_path / "snapshots", tmp_path / "logs")
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    c = Counter(tmp_path / "c.sock", 0, "--shapes", str(shapes))
    try:
        assert c.inc() == 1
        dense_at = mapped_at(c.pid, shapes / "dense")
        info = capture(snap, c.pid, canary=CANARY, identity=identity(snap.criu.version))
    finally:
        c.stop()
    rows = {r.kind: r for r in image_memory(snap.store.path(info.id)) if r.pid == c.pid}
    sparse, dense = rows[f"file {shapes / 'sparse'}"], rows[f"file {shapes / 'dense'}"]
    # One page every 4 MiB: each its own run and its own window.
    assert (sparse.bytes, sparse.areas, sparse.runs, sparse.windows_2m) == (16 * PAGE, 1, 16, 16)
    # 8 MiB written whole: one run (CRIU's pagemap splits it; the row does not), over four
    # windows where it starts on a boundary, five where it does not.
    assert (dense.bytes, dense.areas, dense.runs) == (8 << 20, 1, 1)
    assert dense.windows_2m == (4 if dense_at % HUGE == 0 else 5)
    every = list(rows.values())
    assert all(1 <= r.areas <= r.runs <= r.bytes // PAGE for r in every), every
    assert all(r.bytes <= r.windows_2m * HUGE and r.windows_2m <= r.bytes // PAGE
               for r in every), every


def mapped_at(pid: int, path: Path) -> int:
    """Where the process `pid` maps the file `path` (its first mapping)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith(f" {path}"):
            return int(line.split("-", 1)[0], 16)
    raise AssertionError(f"{path} is not mapped by {pid}")


def test_a_snapshot_without_an_image_is_named_and_nothing_is_printed(tmp_path: Path) -> None:
    empty = tmp_path / "snap"
    (empty / "vllm").mkdir(parents=True)
    assert images_in(empty) is None
    (empty / "vllm" / "images").mkdir()
    (empty / "vllm" / "images" / "pagemap-7.img").write_bytes(b"")
    assert images_in(empty) == empty / "vllm" / "images"
