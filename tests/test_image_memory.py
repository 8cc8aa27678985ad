"""`pitstop snapshot memory`: a real CRIU image's page bytes by process and kind of mapping,
adding up to the image's pages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.checkpoint.image_memory import image_memory, images_in, memory_text
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
        {"pid": r.pid, "kind": r.kind, "bytes": r.bytes} for r in rows]
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


def test_a_snapshot_without_an_image_is_named_and_nothing_is_printed(tmp_path: Path) -> None:
    empty = tmp_path / "snap"
    (empty / "vllm").mkdir(parents=True)
    assert images_in(empty) is None
    (empty / "vllm" / "images").mkdir()
    (empty / "vllm" / "images" / "pagemap-7.img").write_bytes(b"")
    assert images_in(empty) == empty / "vllm" / "images"
