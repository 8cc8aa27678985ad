"""The drift watcher on a real model directory: a rewritten weight is reported once."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from pathlib import Path

from agent.config import parse_config
from agent.drift import Difference
from agent.drift_watch import DriftWatcher
from agent.engines import build_adapter
from agent.identity import HostIdentity
from agent.metrics import Metrics, StatusView, new_registry
from agent.weights import CACHE_NAME, WeightsDigester


def test_a_rewritten_weight_is_reported_once_from_a_worker_thread(
        tiny_model, tmp_path: Path, caplog):
    shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "state").mkdir()
    cfg = parse_config({"engine": {"model": str(tmp_path / "model"), "device": "cpu"},
                        "paths": {"state_dir": str(tmp_path / "state")}}, "test")
    reader = HostIdentity(cfg, build_adapter(cfg), "4.1.1",
                          WeightsDigester(tmp_path / "state" / CACHE_NAME, racy_ns=0))
    threads: set[int] = set()

    def identify():
        threads.add(threading.get_ident())
        return reader()

    reported: list[list[Difference]] = []
    registry = new_registry()
    metrics = Metrics(registry, lambda: StatusView())  # type: ignore[call-arg]

    async def scenario() -> None:
        watcher = DriftWatcher(identify, reader(), reported.append, interval_s=1,
                               metrics=metrics)
        assert await watcher.check() == []
        assert reader.last_weights is not None and reader.last_weights.bytes_read == 0

        with open(tmp_path / "model" / "model.safetensors", "r+b") as f:
            f.seek(-8, 2)
            f.write(b"drifted!")
        with caplog.at_level(logging.INFO, "pitstop.identity"):
            diffs = await watcher.check()
        assert [d.field for d in diffs] == ["weights_digest"]
        assert "changed: changed model.safetensors" in caplog.text
        assert reader.last_weights.files_hashed == 1  # only the changed file was read
        await watcher.check()  # the same drift again: not reported twice
        assert len(reported) == 1

        watcher.rebase(reader())  # e.g. after a regeneration
        assert await watcher.check() == []
        assert threading.get_ident() not in threads  # the loop never hashed

        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(1.5)
        task.cancel()
        assert watcher.checks >= 4

    asyncio.run(scenario())
    assert registry.get_sample_value("pitstop_drift_events_total",
                                     {"field": "weights_digest"}) == 1
