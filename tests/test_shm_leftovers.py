"""A killed engine tree's shared-memory files go once the next engine is ready; the new tree's,
and anything no tree had, stay. A shm directory of the test's own, surveys faked by PID (and
once the real one, of real processes, from /proc)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.checkpoint import outside
from agent.checkpoint.outside import FileId
from agent.config import Config, parse_config
from agent.engines import build_adapter
from agent.engines.base import EngineAdapter
from agent.errors import EngineError, SnapshotError
from agent.metrics import Metrics, StatusView, new_registry
from agent.supervisor.canary import CanaryBook
from agent.supervisor.engine import EngineProcess
from agent.supervisor.gate import EngineGate
from agent.supervisor.ladder import Prepared
from agent.supervisor.paths.cold import ColdStart, ExtraArgs
from agent.supervisor.shm import ShmLeftovers, tree_survey
from agent.supervisor.status import AgentStatus
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from tests.agentproc import agent_config
from tests.frontkit import socket_dir
from tests.snapshot_helpers import lock_held_elsewhere


def _file(shm: Path, name: str, data: bytes = b"x" * 4096) -> FileId:
    (shm / name).write_bytes(data)
    st = os.stat(shm / name)
    return st.st_dev, st.st_ino


class Trees:
    """The fake survey: the files each engine tree (by PID) maps, as the test set them."""

    def __init__(self) -> None:
        self.files: dict[int, dict[FileId, str]] = {}
        self.on_loop: list[bool] = []

    def __call__(self, pid: int) -> dict[FileId, str]:
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        return self.files.get(pid, {})


def test_a_dead_trees_files_go_once_the_next_engine_is_ready_and_no_other_file_does(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="pitstop.supervisor")
    trees = Trees()
    ring, gone = _file(tmp_path, "psm_dead"), _file(tmp_path, "psm_gone")
    # As glibc's sem_open leaves it: mapped under a temporary name since unlinked, the file
    # linked under the semaphore's own name.
    sem = _file(tmp_path, "sem.tmp")
    os.link(tmp_path / "sem.tmp", tmp_path / "sem.mp-dead")
    os.unlink(tmp_path / "sem.tmp")
    _file(tmp_path, "model.safetensors")  # no tree's: stays
    trees.files[100] = {ring: "psm_dead", gone: "psm_gone", sem: ""}
    trees.files[200] = {_file(tmp_path, "psm_new"): "psm_new"}

    async def main() -> None:
        shm = ShmLeftovers(tmp_path, survey=trees)
        shm.ready(100)
        # Nothing ran yet: `ready` returns before its survey, which never holds up the engine.
        assert trees.on_loop == []
        await shm.settled()
        assert (tmp_path / "psm_dead").exists()  # the first engine: no tree before it
        os.unlink(tmp_path / "psm_gone")  # removed by vLLM already: no error
        shm.ready(200)
        await shm.settled()

    asyncio.run(main())
    assert sorted(os.listdir(tmp_path)) == [outside.REMAP_LOCK, "model.safetensors", "psm_new"]
    assert trees.on_loop == [False, False]  # both surveys in worker threads
    assert ("removed 2 shared-memory files (8192 bytes) engine 100 left in "
            f"{tmp_path}: psm_dead, sem.mp-dead") in caplog.text


def test_a_restore_that_puts_its_copies_under_the_dead_trees_names_keeps_them(tmp_path: Path):
    trees = Trees()
    trees.files[100] = {_file(tmp_path, "psm_image", b"dead"): "psm_image"}
    # What put_back does before the restore: the image's copy written, renamed over the name.
    copy = _file(tmp_path, ".copy", b"image")
    os.replace(tmp_path / ".copy", tmp_path / "psm_image")
    trees.files[200] = {copy: "psm_image"}

    async def main() -> None:
        shm = ShmLeftovers(tmp_path, survey=trees)
        shm.ready(100)
        shm.ready(200)  # before the first one's survey ran: the two run in order
        await shm.settled()

    asyncio.run(main())
    assert (tmp_path / "psm_image").read_bytes() == b"image"


def test_a_put_back_that_fails_part_way_takes_back_the_copies_it_wrote(tmp_path: Path):
    image, shm = tmp_path / "image", tmp_path / "shm"
    image.mkdir()
    shm.mkdir()
    (image / f"{outside.PREFIX}psm_a").write_bytes(b"image")  # psm_b's copy is missing
    dead = _file(shm, "psm_a", b"dead")
    with pytest.raises(SnapshotError, match="could not put psm_b back"):
        outside.put_back(image, ("psm_a", "psm_b"), (), shm)
    # The dead tree's psm_a was replaced by the copy, and the copy taken back: nothing of
    # the failed restore stays (the dead file's inode is gone with its name).
    assert sorted(os.listdir(shm)) == [], dead


def test_only_a_copy_still_under_its_name_is_taken_back(tmp_path: Path):
    image = tmp_path / "image"
    image.mkdir()
    for name in ("psm_a", "psm_b"):
        (image / f"{outside.PREFIX}{name}").write_bytes(b"image")
    copies = outside.put_back(image, ("psm_a", "psm_b"), (), tmp_path)
    assert sorted(copies.values()) == ["psm_a", "psm_b"]
    # Another restore on this host put its own psm_b in place since: not our copy.
    _file(tmp_path, ".theirs", b"another restore's")
    os.replace(tmp_path / ".theirs", tmp_path / "psm_b")
    assert outside.take_back(copies, tmp_path).names == ("psm_a",)
    assert (tmp_path / "psm_b").read_bytes() == b"another restore's"


def test_a_file_under_another_name_than_the_dead_tree_mapped_is_not_its_file(tmp_path: Path):
    # A file system that reuses a freed inode number at once (the test's; tmpfs counts up)
    # gives a new file the dead one's identity: the name the tree mapped tells them apart.
    other = _file(tmp_path, "psm_someone_elses")
    assert outside.sweep({other: "psm_dead"}, {}, tmp_path).names == ()
    assert (tmp_path / "psm_someone_elses").exists()


def test_engines_ready_one_after_another_each_sweep_the_tree_before_them(tmp_path: Path):
    trees = Trees()
    for pid in (1, 2, 3):
        trees.files[pid] = {_file(tmp_path, f"psm_{pid}"): f"psm_{pid}"}

    async def main() -> None:
        shm = ShmLeftovers(tmp_path, survey=trees)
        for pid in (1, 2, 3):
            shm.ready(pid)
        await shm.settled()

    asyncio.run(main())
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("psm_")) == ["psm_3"]


def test_a_sweep_waits_for_a_restore_that_puts_files_back_on_this_host(tmp_path: Path):
    """The sweep and put_back take one lock: no restore's copy is replaced between the sweep's
    check of a name and its unlink."""
    dead = {_file(tmp_path, "psm_dead"): "psm_dead"}
    done: list[outside.Swept] = []
    t = threading.Thread(target=lambda: done.append(outside.sweep(dead, {}, tmp_path)))
    with lock_held_elsewhere(tmp_path / outside.REMAP_LOCK):
        t.start()
        time.sleep(0.3)
        assert not done and (tmp_path / "psm_dead").exists()
    t.join(30)
    assert done and done[0].names == ("psm_dead",)


def test_a_tree_that_failed_before_it_was_ready_is_swept_with_the_next_ready(tmp_path: Path):
    trees = Trees()
    trees.files[100] = {_file(tmp_path, "psm_serving"): "psm_serving"}
    trees.files[200] = {_file(tmp_path, "psm_failed"): "psm_failed"}
    trees.files[300] = {_file(tmp_path, "psm_next"): "psm_next"}

    async def main() -> None:
        shm = ShmLeftovers(tmp_path, survey=trees)
        shm.ready(100)
        await shm.settled()
        await shm.failed(200)  # surveyed before its kill, while it lives
        assert (tmp_path / "psm_failed").exists()  # nothing swept before an engine is ready
        shm.ready(300)
        await shm.settled()

    asyncio.run(main())
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("psm_")) == ["psm_next"]
    assert trees.on_loop == [False, False, False]


def test_a_failed_trees_survey_that_hangs_holds_up_its_kill_for_a_bounded_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr("agent.supervisor.shm.FAILED_SURVEY_S", 0.2)
    release = threading.Event()

    def stuck(pid: int) -> dict[FileId, str]:
        release.wait(30)  # reading the maps of a process stuck in the kernel
        return {}

    async def main() -> float:
        t0 = time.monotonic()
        await ShmLeftovers(tmp_path, survey=stuck).failed(200)
        return time.monotonic() - t0

    try:
        assert asyncio.run(main()) < 5
    finally:
        release.set()
    assert "could not list the shared-memory files of engine 200" in caplog.text


def _proc_of_boot(root: Path, boot_id: str) -> Path:
    (root / "sys" / "kernel" / "random").mkdir(parents=True, exist_ok=True)
    (root / "sys" / "kernel" / "random" / "boot_id").write_text(f"{boot_id}\n")
    return root


def _agent_life(shm: Path, trees: Trees, record: Path, proc_root: Path, *pids: int) -> None:
    """One agent's life: each engine of `pids` ready in turn, then the agent gone."""
    async def main() -> None:
        leftovers = ShmLeftovers(shm, survey=trees, record=record, proc_root=proc_root)
        for pid in pids:
            leftovers.ready(pid)
        await leftovers.settled()

    asyncio.run(main())


def test_the_next_agent_removes_what_the_tree_that_died_with_the_agent_before_it_left(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="pitstop.supervisor")
    shm, state = tmp_path / "shm", tmp_path / "state"
    shm.mkdir()
    state.mkdir()
    proc_root = _proc_of_boot(tmp_path / "proc", "boot-1")
    record = state / "engine-shm.json"
    trees = Trees()
    trees.files[100] = {_file(shm, "psm_first"): "psm_first"}
    trees.files[200] = {_file(shm, "psm_second"): "psm_second"}
    trees.files[300] = {_file(shm, "psm_third"): "psm_third"}
    # The first agent: engine 100 crashed, 200 served when the agent itself died.
    _agent_life(shm, trees, record, proc_root, 100, 200)
    assert sorted(os.listdir(shm)) == [outside.REMAP_LOCK, "psm_second", "psm_third"]
    assert json.loads(record.read_text())["pid"] == 200
    # The next agent, on the same state directory: its first engine sweeps 200's files.
    _agent_life(shm, trees, record, proc_root, 300)
    assert sorted(os.listdir(shm)) == [outside.REMAP_LOCK, "psm_third"]
    assert json.loads(record.read_text())["pid"] == 300
    assert f"engine 200 left in {shm}: psm_second" in caplog.text


def test_a_record_of_another_boot_or_that_does_not_read_removes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    shm, state = tmp_path / "shm", tmp_path / "state"
    shm.mkdir()
    state.mkdir()
    record = state / "engine-shm.json"
    trees = Trees()
    trees.files[100] = {_file(shm, "psm_old"): "psm_old"}
    trees.files[200] = {_file(shm, "psm_new"): "psm_new"}
    trees.files[300] = {_file(shm, "psm_newer"): "psm_newer"}
    _agent_life(shm, trees, record, _proc_of_boot(tmp_path / "proc-1", "boot-1"), 100)
    # After a reboot, the same inode numbers and names could be other files.
    _agent_life(shm, trees, record, _proc_of_boot(tmp_path / "proc-2", "boot-2"), 200)
    assert (shm / "psm_old").exists()
    record.write_text("{not json")
    _agent_life(shm, trees, record, _proc_of_boot(tmp_path / "proc-2", "boot-2"), 300)
    assert (shm / "psm_new").exists()
    assert f"ignoring {record}, which does not read as a record" in caplog.text
    assert json.loads(record.read_text())["pid"] == 300  # written again, whole


# A root that maps what vLLM's processes map, and a child of it that maps a file of its own.
MAPPER = """
import mmap, os, subprocess, sys
shm, role, me = sys.argv[1:4]
def mapped(name, shared=True, write=True):
    fd = os.open(os.path.join(shm, name), os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096, mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE,
                  mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
    os.close(fd)
    return m
if role == "child":
    keep = [mapped("psm_child")]
else:
    keep = [mapped("psm_root"), mapped("sem.tmp"), mapped("model", write=False),
            mapped("private", shared=False), mapped("sub/psm_deeper")]
    os.link(os.path.join(shm, "sem.tmp"), os.path.join(shm, "sem.mp-x"))
    os.unlink(os.path.join(shm, "sem.tmp"))
    kid = subprocess.Popen([sys.executable, "-c", me, shm, "child", me], stdout=subprocess.PIPE)
    kid.stdout.readline()
print("ready", flush=True)
sys.stdin.readline()
"""


def _mapper(shm: Path) -> subprocess.Popen[str]:
    """MAPPER's root and child, in a session of their own, each file mapped."""
    (shm / "sub").mkdir()
    p = subprocess.Popen([sys.executable, "-c", MAPPER, str(shm), "root", MAPPER],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def test_the_survey_finds_the_files_a_tree_maps_shared_and_writable_in_the_shm_dir(
        tmp_path: Path):
    p = _mapper(tmp_path)
    try:
        found = tree_survey(tmp_path)(p.pid)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def ident(name: str) -> FileId:
        st = os.stat(tmp_path / name)
        return st.st_dev, st.st_ino

    # The root's, its child's and the semaphore's (under its linked name); not the file it
    # only reads, nor its private mapping, nor one in a directory below.
    assert found == {ident("psm_root"): "psm_root", ident("psm_child"): "psm_child",
                     ident("sem.mp-x"): ""}, found


def test_the_survey_of_a_tree_whose_root_died_finds_the_rest_of_its_group(tmp_path: Path):
    p = _mapper(tmp_path)
    try:
        p.kill()  # the root only: its child lives on in the root's group and session
        p.wait()
        found = tree_survey(tmp_path)(p.pid)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
    st = os.stat(tmp_path / "psm_child")
    assert found == {(st.st_dev, st.st_ino): "psm_child"}, found


class Rings:
    """The survey of real engines faked as vLLM makes its files: a ring buffer per tree, under
    a name of its own, made when the tree is first surveyed."""

    def __init__(self, shm: Path) -> None:
        self.shm = shm
        self.made: dict[int, FileId] = {}

    def __call__(self, pid: int) -> dict[FileId, str]:
        self.made.setdefault(pid, _file(self.shm, f"psm_{pid}"))
        return {self.made[pid]: f"psm_{pid}"}


@pytest.mark.integration
def test_the_supervisor_sweeps_after_each_ready_engine(tiny_model: Path, tmp_path: Path):
    """The real supervisor and reference engine: a crash, then a cold start."""
    rings = Rings(tmp_path)
    asyncio.run(_crash_then_cold(tiny_model, ShmLeftovers(tmp_path, survey=rings)))
    [first, second] = rings.made
    assert not (tmp_path / f"psm_{first}").exists()
    assert (tmp_path / f"psm_{second}").exists()


class FailsOnce(ColdStart):
    """A cold start whose first engine fails after it answered (as a canary that differs
    does): the supervisor kills it and tries the next rung."""

    def __init__(self, adapter: EngineAdapter) -> None:
        super().__init__(adapter)
        self.failed_pids: list[int] = []

    async def after_verified(self, engine: EngineProcess, prepared: Prepared[ExtraArgs]) -> None:
        if not self.failed_pids:
            self.failed_pids.append(engine.pid)
            raise EngineError("the test's first engine fails")


@pytest.mark.integration
def test_the_supervisor_sweeps_what_a_start_that_failed_left(tiny_model: Path, tmp_path: Path):
    rings = Rings(tmp_path)

    async def main() -> list[int]:
        d = socket_dir()
        cfg = parse_config(agent_config(d, tiny_model), "test")
        adapter = build_adapter(cfg)
        failing = FailsOnce(adapter)
        status = AgentStatus()
        shm = ShmLeftovers(tmp_path, survey=rings)
        sup = _supervisor(cfg, adapter, status, shm, [failing, ColdStart(adapter)], d)
        run = asyncio.ensure_future(sup.run())
        try:
            await _until_ready(run, status, 0)
            await shm.settled()
        finally:
            sup.request_stop()
            await asyncio.wait_for(run, 60)
        return [*failing.failed_pids, status.last_recovery.path]  # type: ignore[union-attr]

    [failed, path] = asyncio.run(main())
    assert path == "cold"
    [first, second] = rings.made
    assert first == failed
    assert not (tmp_path / f"psm_{failed}").exists()
    assert (tmp_path / f"psm_{second}").exists()


def _supervisor(cfg: Config, adapter: EngineAdapter, status: AgentStatus, shm: ShmLeftovers,
                paths: list[ColdStart], d: Path) -> Supervisor:
    metrics = Metrics(new_registry(), lambda: StatusView("", False, None, (), None))  # type: ignore[arg-type]
    return Supervisor(
        config=cfg, adapter=adapter, gate=EngineGate(), metrics=metrics, notifier=Notifier({}),
        status=status, canaries=CanaryBook(d / "canary.json"), paths=paths, shm=shm)


async def _until_ready(run: asyncio.Future[None], status: AgentStatus, restarts: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while not (status.state == "ready" and status.restarts == restarts):
        assert not run.done(), f"the supervisor ended: {run.exception()!r}"
        assert loop.time() < deadline, f"not ready: {status}"
        await asyncio.sleep(0.05)


async def _crash_then_cold(tiny_model: Path, shm: ShmLeftovers) -> None:
    d = socket_dir()
    cfg = parse_config(agent_config(d, tiny_model), "test")
    adapter = build_adapter(cfg)
    status = AgentStatus()
    sup = _supervisor(cfg, adapter, status, shm, [ColdStart(adapter)], d)
    run = asyncio.ensure_future(sup.run())
    try:
        for restarts in (0, 1):
            await _until_ready(run, status, restarts)
            await shm.settled()
            if restarts == 0:
                assert status.engine_pid is not None
                os.kill(status.engine_pid, signal.SIGKILL)
    finally:
        sup.request_stop()
        await asyncio.wait_for(run, 60)
