"""The holder with the cpu backend: real holder processes, real sockets, real tenants."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.errors import HolderRefusedError, HolderUnavailableError, MappingError
from agent.holder import protocol as p
from agent.holder.client import HolderClient
from agent.tenant.mapping import HeldSet, HostSpace
from tests.holder_proc import Holder, wait_for
from tests.holder_tenant import digest_of, pattern

REPO = Path(__file__).resolve().parent.parent
TENANT = Path(__file__).resolve().parent / "holder_tenant.py"
DIGEST = "sha256-0123abcd"
MIB = 1 << 20


def spawn_tenant(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(TENANT), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def tenant_event(t: subprocess.Popen) -> dict:
    assert t.stdout is not None
    line = t.stdout.readline()
    if not line:
        t.wait(10)
        raise AssertionError(f"tenant exited {t.returncode}: {t.stderr.read()}")  # type: ignore
    return json.loads(line)


def kill(t: subprocess.Popen) -> None:
    t.kill()
    t.wait(10)
    for f in (t.stdout, t.stderr):
        if f:
            f.close()


def write_committed(holder: Holder, sizes: dict[str, int], seed: int = 1) -> dict[str, str]:
    """A writer process commits `sizes`, then is SIGKILLed; returns the sums it wrote."""
    w = spawn_tenant("write", str(holder.sock), DIGEST, json.dumps(sizes), str(seed), "commit")
    try:
        return tenant_event(w)["sums"]
    finally:
        kill(w)


def write_here(holder: Holder, sizes: dict[str, int], seed: int = 1) -> dict[str, str]:
    """Commit `sizes` from this process (quicker than a writer process), then unmap."""
    import torch

    sums = {}
    with holder.client() as c:
        held = HeldSet.create(c, DIGEST, sizes, HostSpace)
        for i, name in enumerate(sorted(sizes)):
            data = pattern(seed + i, sizes[name])
            held.tensor(name).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            sums[name] = digest_of(held.tensor(name))
        held.commit()
        held.close()
    return sums


SIZES = {f"{DIGEST}/a.safetensors": 3 * MIB + 123, f"{DIGEST}/b.safetensors": 1 * MIB}


def test_committed_memory_outlives_its_writer_and_a_second_tenant_reads_it(holder):
    sums = write_committed(holder, SIZES)
    # The writer is dead; its memory lives on in the holder.
    with holder.client() as c:
        assert c.has_committed(DIGEST)
        regions = c.committed_set(DIGEST)
        assert c.list("sha256-other") == [] and len(c.list(DIGEST)) == 2
    assert regions is not None and {r.name for r in regions} == set(SIZES)
    assert all(r.epoch == 1 and r.parts == 2 for r in regions)
    r = spawn_tenant("read", str(holder.sock), DIGEST)
    try:
        assert tenant_event(r)["sums"] == sums
    finally:
        kill(r)
    assert holder.stats().bytes_committed >= sum(SIZES.values())
    assert holder.stats().bytes_pending == 0


def test_a_writer_killed_before_commit_leaves_nothing_attachable_and_nothing_held(holder):
    base_fds = len(holder.fds())
    w = spawn_tenant("write", str(holder.sock), DIGEST, json.dumps(SIZES), "1", "nocommit")
    try:
        tenant_event(w)
        st = holder.stats()
        assert st.bytes_pending >= sum(SIZES.values()) and st.bytes_committed == 0
        with holder.client() as c, pytest.raises(HolderRefusedError) as e:
            c.attach(f"{DIGEST}/a.safetensors")
        assert e.value.code == "not_committed"
    finally:
        kill(w)
    wait_for(lambda: holder.stats().bytes_pending == 0, "the holder to drop the pending regions")
    st = holder.stats()
    assert (st.bytes_committed, st.regions_pending, st.regions_committed) == (0, 0, 0)
    with holder.client() as c:
        assert c.list() == []
        assert not c.has_committed(DIGEST)
        with pytest.raises(HolderRefusedError) as e:
            c.attach(f"{DIGEST}/a.safetensors")
        assert e.value.code == "not_found"
    assert holder.memfds() == []
    assert len(holder.fds()) == base_fds
    assert holder.settled_sessions() == 0


def test_a_peer_of_another_uid_is_refused(holder):
    # Simulate loosened file permissions: SO_PEERCRED must still keep the stranger out.
    os.chmod(holder.sock.parent, 0o711)
    os.chmod(holder.sock, 0o666)
    request = p.encode(p.StatsRequest())
    pid = os.fork()
    if pid == 0:  # the child: become nobody, connect, report what the holder said
        code = 3
        try:
            # pytest's tmp root is 0700: enter the holder's directory while still root,
            # so the stranger reaches the socket by a relative name.
            os.chdir(holder.sock.parent)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(10)
            s.connect(p.SOCKET_NAME)
            s.send(request)
            reply = p.parse_reply(s.recv(p.MAX_MESSAGE))
            code = 0 if (not reply.ok and reply.error and
                         reply.error.code == p.ErrorCode.FORBIDDEN) else 1
            if s.recv(p.MAX_MESSAGE) != b"":  # and the holder closed the session
                code = 2
        except BaseException as e:
            print(f"stranger: {e!r}", file=sys.stderr)
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "refused pid" in holder.log.read_text()
    assert holder.settled_sessions() == 0  # the stranger's session is gone; still serving


def test_client_mistakes_get_an_answer_and_the_session_goes_on(holder):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(holder.sock))
    for bad, code in [(b"not json", "bad_request"), (b'{"v": 9, "op": "list"}', "version"),
                      (b'{"v": 1, "op": "frobnicate"}', "bad_request"),
                      (b'{"v": 1, "op": "create", "name": "../x y", "size": 1, "digest": "d"}',
                       "bad_request"),
                      (b'{"v": 1, "op": "attach", "name": "nope"}', "not_found"),
                      (b'{"v": 1, "op": "commit", "name": "nope"}', "not_found")]:
        s.send(bad)
        reply = p.parse_reply(s.recv(p.MAX_MESSAGE))
        assert not reply.ok and reply.error is not None and reply.error.code == code, bad
    s.send(p.encode(p.StatsRequest()))
    assert p.parse_reply(s.recv(p.MAX_MESSAGE)).ok
    s.close()


def test_only_the_writer_commits_and_a_second_writer_is_told_busy(holder):
    name = f"{DIGEST}/x"
    with holder.client() as w, holder.client() as other:
        w.create(name, MIB, DIGEST).close()
        with pytest.raises(HolderRefusedError) as e:
            other.create(name, MIB, DIGEST)
        assert e.value.code == "busy"
        with pytest.raises(HolderRefusedError) as e:
            other.commit(name)
        assert e.value.code == "not_owner"
        assert w.commit(name).committed
        # Replacing: a new epoch; the old version stays attachable until the commit.
        w.create(name, MIB, DIGEST).close()
        with other.attach(name) as g:
            assert g.region.epoch == 1
        assert w.commit(name).epoch == 2
        with other.attach(name) as g:
            assert g.region.epoch == 2
    assert holder.stats().bytes_committed == MIB


def test_release_frees_the_memory(holder):
    write_here(holder, SIZES)
    assert len(holder.memfds()) == 2
    with holder.client() as c:
        for name in SIZES:
            c.release(name)
        with pytest.raises(HolderRefusedError) as e:
            c.release(f"{DIGEST}/a.safetensors")
        assert e.value.code == "not_found"
    st = holder.stats()
    assert (st.bytes_held, st.regions_committed) == (0, 0)
    assert holder.memfds() == []


def test_a_drop_frees_every_region_at_once_and_the_holder_serves_on(holder):
    write_here(holder, SIZES)
    with holder.client() as writer, holder.client() as agent:
        writer.create(f"{DIGEST}/half-written", MIB, DIGEST).close()
        dropped = agent.drop(p.DropReason.GPU_FAULT, "Xid 48 (double-bit ECC error)")
        assert dropped.regions == len(SIZES) + 1
        assert dropped.bytes >= sum(SIZES.values()) + MIB
        # The writer of a dropped region learns it at its commit; nothing turns up later.
        with pytest.raises(HolderRefusedError) as e:
            writer.commit(f"{DIGEST}/half-written")
        assert e.value.code == "not_found"
        assert not agent.has_committed(DIGEST)
        # Held memory that was suspect is gone; new weights can be held again at once.
        agent.create(f"{DIGEST}/again", MIB, DIGEST).close()
        assert agent.commit(f"{DIGEST}/again").epoch == 1
    st = holder.stats()
    assert (st.regions_committed, st.regions_pending, st.bytes_held) == (1, 0, MIB)
    assert len(holder.memfds()) == 1
    assert "dropped all 3 regions" in holder.log.read_text()
    assert "(gpu_fault): Xid 48 (double-bit ECC error)" in holder.log.read_text()


def test_a_drop_without_a_reason_is_answered_as_a_bad_request(holder):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(holder.sock))
        s.send(json.dumps({"v": 1, "op": "drop"}).encode())
        reply = p.parse_reply(s.recv(p.MAX_MESSAGE))
    assert not reply.ok and reply.error is not None
    assert reply.error.code == p.ErrorCode.BAD_REQUEST and "reason" in reply.error.message
    assert holder.stats().regions_committed == 0  # and it serves on


def test_the_holder_cli_shows_and_releases(holder):
    write_here(holder, SIZES)
    run = [sys.executable, "-m", "agent", "holder", "--gpu", "cpu", "--dir", str(holder.base)]
    out = subprocess.run([*run, "status"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{DIGEST}/a.safetensors" in out.stdout and "committed" in out.stdout
    out = subprocess.run([*run, "release", "--all"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert holder.stats().bytes_held == 0


def test_a_second_holder_for_the_same_gpu_is_refused(holder):
    out = subprocess.run([sys.executable, "-m", "agent", "holder", "--gpu", "cpu", "--dir",
                          str(holder.base)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "already serves" in out.stderr
    assert holder.stats().pid == holder.proc.pid


def _maps() -> str:
    return Path("/proc/self/maps").read_text()


def _mapping_at(base: int) -> str:
    for line in _maps().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= base < hi:
            return line
    return ""


def test_detach_unmaps_keeps_the_reservation_and_reattach_restores_the_same_bytes(holder):
    sums = write_here(holder, SIZES)
    with holder.client() as c:
        held = HeldSet.attach(c, DIGEST, HostSpace)
    try:
        a = f"{DIGEST}/a.safetensors"
        before = held.tensor(a)  # made before the detach, used after the re-attach
        floats = before[: 4096].view(dtype=__import__("torch").float32)
        first = floats.clone()
        assert digest_of(before) == sums[a]
        assert "memfd:pitstop:" in _maps()
        held.detach()
        assert "memfd:pitstop:" not in _maps()
        reserved = _mapping_at(held.space.base)
        assert reserved.split()[1] == "---p", reserved  # PROT_NONE, private, anonymous
        lo, hi = (int(x, 16) for x in reserved.split()[0].split("-"))
        assert lo <= held.space.base and hi >= held.space.base + held.space.size
        assert holder.settled_sessions() == 0
        with holder.client() as c:
            held.reattach(c)
        assert digest_of(before) == sums[a]
        assert bool((floats == first).all())
        assert all(digest_of(held.tensor(n)) == sums[n] for n in SIZES)
    finally:
        held.close()


def test_reattach_refuses_a_replaced_region_or_another_holder(holder, tmp_path):
    write_here(holder, SIZES)
    with holder.client() as c:
        held = HeldSet.attach(c, DIGEST, HostSpace)
    try:
        held.detach()
        write_here(holder, SIZES, seed=7)  # same names, new bytes: epoch 2
        with holder.client() as c, pytest.raises(MappingError, match="epoch 1 -> 2"):
            held.reattach(c)
        assert not held.attached and "memfd:pitstop:" not in _maps()
    finally:
        held.close()
    other = Holder(tmp_path / "other")
    try:
        write_here(other, SIZES)
        with holder.client() as c:
            held = HeldSet.attach(c, DIGEST, HostSpace)
        held.detach()
        with other.client() as c, pytest.raises(MappingError, match="holder_id"):
            held.reattach(c)
        held.close()
    finally:
        assert other.stop() == 0


def test_a_hundred_attach_detach_cycles_leak_nothing(holder):
    write_here(holder, SIZES)
    with holder.client() as c:
        held = HeldSet.attach(c, DIGEST, HostSpace)
    try:
        own_fds = len(os.listdir("/proc/self/fd"))
        held_fds, rss, held_bytes = len(holder.fds()), holder.rss_kib(), holder.stats().bytes_held
        for _ in range(100):
            held.detach()
            with holder.client() as c:
                held.reattach(c)
        assert len(os.listdir("/proc/self/fd")) == own_fds
        assert len(holder.fds()) == held_fds
        assert holder.stats().bytes_held == held_bytes
        assert holder.settled_sessions() == 0
        # The holder's RSS stays roughly flat (allocator noise only).
        assert holder.rss_kib() - rss < 8 * 1024
        assert _maps().count("memfd:pitstop:") == 2
    finally:
        held.close()
    assert "memfd:pitstop:" not in _maps()


def test_sigterm_frees_everything_and_removes_the_socket(tmp_path):
    h = Holder(tmp_path / "h")
    write_here(h, SIZES)
    assert h.stop() == 0
    assert not h.sock.exists()
    assert "freed" in h.log.read_text()
    with pytest.raises(HolderUnavailableError, match="no holder answers"), h.client() as c:
        c.stats()


def test_the_holder_dir_is_private(holder):
    assert holder.sock.parent.stat().st_mode & 0o777 == 0o700
    assert holder.sock.stat().st_mode & 0o777 == 0o600


def test_a_region_written_again_under_its_name_is_read_with_its_new_bytes(holder):
    first = write_here(holder, SIZES)
    again = write_here(holder, SIZES, seed=7)  # same names, other bytes: epoch 2
    assert set(first.values()).isdisjoint(again.values())  # two writes told apart
    r = spawn_tenant("read", str(holder.sock), DIGEST)
    try:
        assert tenant_event(r)["sums"] == again
    finally:
        kill(r)
    with holder.client() as c:
        assert {r.epoch for r in c.list(DIGEST)} == {2}
    # The first version's memory went back when the second was committed.
    assert holder.stats().bytes_committed < 2 * sum(SIZES.values())


def test_stale_reason_names_what_changed_in_the_holder(holder):
    from agent.holder.client import stale_reason

    # Named otherwise than by their digest: not content-addressed, every version counts.
    sizes = {"kv/a": 3 * MIB, "kv/b": MIB}
    write_here(holder, sizes)
    with holder.client() as c:
        held = HeldSet.attach(c, DIGEST, HostSpace)
    expected = held.identity
    held.close()
    with holder.client() as c:
        assert stale_reason(c, expected) is None
    write_here(holder, sizes, seed=3)
    with holder.client() as c:
        assert "epoch 1 -> 2" in (stale_reason(c, expected) or "")
        c.release("kv/a")
        assert "is gone" in (stale_reason(c, expected) or "")


def test_weights_loaded_again_under_their_digest_are_not_stale_but_other_chunks_are(holder):
    """Weights regions are named by their digest, which fixes their bytes: loaded again (by
    a tenant, or by the holder's refill) they are the same weights at another epoch."""
    from agent.holder.client import stale_reason

    write_here(holder, SIZES)
    with holder.client() as c:
        held = HeldSet.attach(c, DIGEST, HostSpace)
    expected = held.identity
    held.close()
    write_here(holder, SIZES)
    with holder.client() as c:
        assert {r.epoch for r in c.committed_set(DIGEST)} == {2}
        assert stale_reason(c, expected) is None
    write_here(holder, {**SIZES, f"{DIGEST}/a.safetensors": 5 * MIB})
    with holder.client() as c:
        assert "chunks" in (stale_reason(c, expected) or "")
        c.release(f"{DIGEST}/a.safetensors")
        assert "is gone" in (stale_reason(c, expected) or "")
    assert "holder unavailable" in (stale_reason(HolderClient(holder.base / "nope"), expected)
                                    or "")


def test_a_list_too_large_for_one_answer_is_refused_and_the_holder_serves_on(holder):
    with holder.client() as c:
        for i in range(400):
            c.create(f"many/{i:04d}-{'x' * 40}", 4096, "many").close()
        with pytest.raises(HolderRefusedError, match="ask for one digest") as e:
            c.list()
        assert e.value.code == "bad_request"
        assert c.stats().regions_pending == 400 and c.list("other") == []
    wait_for(lambda: holder.stats().regions_pending == 0, "the writer's regions to go")
    assert holder.memfds() == []


LEASED_TENANT = """
import sys, time
from agent.holder.client import HolderClient
with HolderClient(sys.argv[1]) as c:
    c.create("kv/pool", 1 << 20, "kv-1", lease_s=float(sys.argv[2])).close()
    c.commit("kv/pool")
print("committed", flush=True)
time.sleep(600)
"""


def leased_tenant(holder: Holder, lease_s: float) -> subprocess.Popen:
    """A process that leaves a committed region of `lease_s` and lives on (its connection
    closed: the claim is the process, not a session)."""
    t = subprocess.Popen([sys.executable, "-c", LEASED_TENANT, str(holder.sock), str(lease_s)],
                         cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert t.stdout is not None and t.stdout.readline() == "committed\n"
    return t


def test_a_leased_region_outlives_its_tenant_for_the_lease_then_the_holder_releases_it(
        holder):
    t = leased_tenant(holder, 1.0)
    time.sleep(1.5)  # claimed while its process lives: the lease does not run
    assert holder.stats().regions_committed == 1
    kill(t)
    # A successor attaching within the lease finds it.
    with holder.client() as c, c.attach("kv/pool") as g:
        assert g.region.lease_s == 1.0
    assert holder.stats().regions_committed == 1


def test_a_leased_region_nobody_claims_is_released_after_its_lease(holder):
    kill(leased_tenant(holder, 1.0))
    wait_for(lambda: holder.stats().regions_committed == 0, "the lease to run out", 5)
    assert holder.stats().bytes_held == 0
    assert "unclaimed for its lease of 1s" in holder.log.read_text()


def test_a_leased_region_is_one_processs_at_a_time(holder):
    t = leased_tenant(holder, 60)
    try:
        with holder.client() as c, pytest.raises(HolderRefusedError) as e:
            c.attach("kv/pool")
        assert e.value.code == p.ErrorCode.BUSY and f"pid {t.pid}" in str(e.value)
    finally:
        kill(t)
    with holder.client() as c, c.attach("kv/pool"):
        pass  # its claimant exited: free to claim


def test_host_memory_is_a_memfd_on_any_backend(holder):
    with holder.client() as c:
        with c.create("kv/ledger", 4096, "kvledger-1", memory=p.MemoryKind.HOST) as g:
            assert g.region.memory is p.MemoryKind.HOST
            assert os.readlink(f"/proc/self/fd/{g.fds[0]}").startswith(
                "/memfd:pitstop:kv/ledger")
        c.commit("kv/ledger")
        [r] = c.list("kvledger-1")
        assert r.memory is p.MemoryKind.HOST and r.lease_s is None


def test_a_lease_out_of_range_is_a_bad_request(holder):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(holder.sock))
    s.send(json.dumps({"v": 1, "op": "create", "name": "kv/x", "size": 1, "digest": "d",
                       "lease_s": -1}).encode())
    reply = p.parse_reply(s.recv(p.MAX_MESSAGE))
    s.close()
    assert reply.error is not None and reply.error.code == p.ErrorCode.BAD_REQUEST
    assert "lease_s" in reply.error.message


def test_a_set_attached_by_digest_reattaches_the_same_weights_loaded_into_a_new_holder(
        tmp_path):
    """What a refill gives a restored engine: another holder, epoch 1 again, the same
    digest, sizes and bytes. A set attached by digest maps them; a strict one refuses."""
    first = Holder(tmp_path / "first")
    sums = write_here(first, SIZES)
    with first.client() as c:
        by_digest = HeldSet.attach(c, DIGEST, HostSpace, by_digest=True)
        strict = HeldSet.attach(c, DIGEST, HostSpace)
    by_digest.detach()
    strict.detach()
    assert first.stop() == 0
    second = Holder(tmp_path / "second")
    try:
        write_here(second, SIZES)  # the same bytes: what loading the same files gives
        with second.client() as c:
            by_digest.reattach(c)
            with pytest.raises(MappingError, match="holder_id"):
                strict.reattach(c)
        assert all(digest_of(by_digest.tensor(n)) == sums[n] for n in SIZES)
        assert {pl.region.holder_id for pl in by_digest.placements.values()} == \
            {second.stats().holder_id}  # what the next image records
    finally:
        by_digest.close()
        strict.close()
        assert second.stop() == 0


def test_a_holder_directory_too_long_for_a_unix_socket_is_refused_by_name(tmp_path):
    deep = tmp_path / ("d" * 100)
    out = subprocess.run([sys.executable, "-m", "agent", "holder", "--gpu", "cpu", "--dir",
                          str(deep)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert "at most 107" in out.stderr and "holder.dir" in out.stderr
