"""Two hosts on this machine and one real S3-compatible server: host A snapshots the
reference engine and pushes it; host B, which never started the engine, pulls it and comes
back through the refill rung (weights from the model files into its holder, then the small
hybrid image), not a cold start, with the same answer. Hosts whose pull is refused (a
tampered object, another kernel, a cut download) cold-start and say why.

The hosts share what a fleet's one configuration makes equal on every node (the engine's
socket, the holder's directory: both are in the engine's image) and nothing else: each
has its own state directory, snapshot store, run directory and holder process.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agentproc import REPO, RunningAgent, agent_config, complete, snapshot_list
from tests.conftest import module_scratch
from tests.holder_proc import Holder
from tests.s3_server import CuttingProxy, S3Server, s3_server
from tests.snapshot_helpers import criu

pytestmark = pytest.mark.integration

BUCKET = "fleet"
URL = f"s3://{BUCKET}/tiny"
PROMPT = "The fleet"


@dataclass(frozen=True)
class Fleet:
    server: S3Server
    shared: Path
    model: Path
    snapshot: str  # what host A pushed
    answer: str  # host A's greedy answer to PROMPT

    def host(self, name: str, **snapshots: object) -> dict:
        """A node's configuration: its own state, the fleet's socket and holder paths."""
        tmp = self.shared.parent / name
        tmp.mkdir()
        cfg = agent_config(tmp, self.model, engine={"socket": str(self.shared / "engine.sock")},
                           holder={"enabled": True, "dir": str(self.shared / "holder"),
                                   "gpu": "cpu"},
                           snapshots={"remote": URL, **snapshots})
        return cfg

    def start(self, name: str, *, env: dict | None = None, pitstop: Path | None = None,
              **snapshots: object) -> RunningAgent:
        cfg = self.host(name, **snapshots)
        tmp = Path(cfg["paths"]["state_dir"]).parent
        return RunningAgent(tmp, cfg, env={**self.server.env(), **(env or {})},
                            pitstop=pitstop)


def fresh_holder(fleet: Fleet) -> Holder:
    """An empty holder where the fleet's configuration puts it: nothing held, no plan."""
    shutil.rmtree(fleet.shared / "holder", ignore_errors=True)
    return Holder(fleet.shared / "holder")


def metric(a: RunningAgent, sample: str) -> float:
    with urllib.request.urlopen(a.metrics_url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {sample} in the agent's metrics")


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """Host A made the fleet's snapshot and pushed it (snapshots.publish), then stopped."""
    criu()
    with module_scratch(request, "fleet") as tmp:
        shared = tmp / "shared"
        shared.mkdir()
        with s3_server(tmp / "aws") as server:
            server.create_bucket(BUCKET)
            seeding = Fleet(server, shared, tiny_model, "", "")
            holder = fresh_holder(seeding)
            a = seeding.start("host-a", publish=True)
            try:
                a.wait_ready()
                st = a.wait_for(lambda s: (s.get("last_push") or {}).get("result") == "ok", 180,
                                "the snapshot pushed")
                answer = complete(a, PROMPT)
                assert st["last_push"]["kind"] == "hybrid" and st["last_push"]["bytes"] > 0, st
                assert st["last_pull"]["result"] == "no_snapshot", st  # the first node: none yet
                pushed = st["last_push"]["snapshot"]
            finally:
                a.stop()
                holder.stop()
            yield Fleet(server, shared, tiny_model, pushed, answer)


def test_a_host_that_never_ran_the_engine_pulls_and_restores_through_refill(fleet: Fleet):
    holder = fresh_holder(fleet)
    b = fleet.start("host-b")
    try:
        st = b.wait_ready()
        rec, pulled = st["last_recovery"], st["last_pull"]
        assert (pulled["result"], pulled["snapshot"], pulled["kind"]) == \
            ("ok", fleet.snapshot, "hybrid"), st
        assert pulled["bytes"] > 0 and pulled["seconds"] > 0
        assert rec["path"] == "refill", (rec, b.log_tail())
        assert {"pull", "refill", "criu_restore", "resume"} <= set(rec["stages"]), rec
        # Verified by the canary host A recorded, and answering as host A did.
        assert complete(b, PROMPT) == fleet.answer
        assert [s["id"] for s in snapshot_list(b)] == [fleet.snapshot]
        assert metric(b, 'pitstop_snapshot_transfers_total{direction="pull",result="ok"}') == 1
        assert holder.stats().bytes_held > 0  # the weights, loaded by the holder itself
    finally:
        b.stop()
        holder.stop()


def refused_cold(fleet: Fleet, a: RunningAgent, code: str) -> dict:
    """The agent cold-started after its pull was refused with `code`; nothing was pulled."""
    st = a.wait_ready()
    assert st["last_pull"]["result"] == code, st["last_pull"]
    assert st["last_recovery"]["path"] == "cold", st["last_recovery"]
    assert snapshot_list(a) == []  # regenerate: manual, and nothing half-pulled published
    assert metric(a, f'pitstop_snapshot_transfers_total{{direction="pull",result="{code}"}}') \
        == 1
    return st


def test_a_tampered_object_is_refused_by_name_and_the_host_cold_starts(fleet: Fleet):
    import boto3

    s3 = boto3.session.Session().client(
        "s3", endpoint_url=fleet.server.endpoint, region_name="us-east-1",
        aws_access_key_id="test", aws_secret_access_key="test")
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="tiny/chunks/")
               ["Contents"] if o["Size"] > 1000)
    good = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(reversed(good)))
    holder = fresh_holder(fleet)
    e = fleet.start("host-tampered", regenerate="manual")
    try:
        st = refused_cold(fleet, e, "corrupt")
        assert f"object {URL}/{key.removeprefix('tiny/')} is corrupt" in \
            st["last_pull"]["detail"], st["last_pull"]
    finally:
        e.stop()
        holder.stop()
        s3.put_object(Bucket=BUCKET, Key=key, Body=good)


def test_a_host_with_another_kernel_is_refused_naming_it_and_cold_starts(fleet: Fleet,
                                                                        tmp_path: Path):
    # setarch's UNAME26 personality makes uname(2) report a 2.6 kernel to the agent and
    # everything it starts: another kernel string, as another host would have.
    wrapper = tmp_path / "pitstop-uname26"
    wrapper.write_text(f"#!/bin/sh\ncd {REPO} && exec setarch {platform.machine()} "
                       f"--uname-2.6 {sys.executable} -m agent \"$@\"\n")
    wrapper.chmod(0o755)
    holder = fresh_holder(fleet)
    d = fleet.start("host-kernel", pitstop=wrapper, regenerate="manual")
    try:
        st = refused_cold(fleet, d, "stale")
        assert f"the newest, {fleet.snapshot}, differs: kernel: '{os.uname().release}' -> " \
            "'2.6." in st["last_pull"]["detail"], st["last_pull"]
    finally:
        d.stop()
        holder.stop()


def test_an_interrupted_download_publishes_nothing_and_the_host_cold_starts(fleet: Fleet):
    proxy = CuttingProxy(fleet.server.endpoint, cut_after=1 << 20)
    holder = fresh_holder(fleet)
    f = fleet.start("host-cut", env=fleet.server.env(proxy.endpoint), regenerate="manual")
    try:
        st = refused_cold(fleet, f, "transfer_failed")
        assert f"pull of snapshot {fleet.snapshot} from {URL}" in st["last_pull"]["detail"]
        assert proxy.cuts > 0
        store = Path(f.config["paths"]["state_dir"]) / "snapshots"
        assert [n for n in os.listdir(store) if not n.startswith(".logs")] == []
    finally:
        f.stop()
        holder.stop()
        proxy.close()
