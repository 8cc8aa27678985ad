"""The KV ledger: what a writer killed at any store leaves is the old entry or the new one."""

from __future__ import annotations

import contextlib

import torch

from agent.engines.refengine.keptkv import kv_fingerprints
from agent.holder.kvledger import HEADER_BYTES, Entry, KeptKVOutcome, Ledger, LedgerShape, Torn

SHAPE = LedgerShape(entries=2, max_tokens=64, max_blocks=1, fp_block=4)


class Killed(Exception):
    pass


class DiesAfter:
    """A buffer whose writer is killed at its `n`-th store: that store and later ones never
    happen, as when SIGKILL lands between two stores into holder memory."""

    def __init__(self, data: bytearray, n: int) -> None:
        self.data, self.left = data, n

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, k: slice) -> bytes:
        return bytes(self.data[k])

    def __setitem__(self, k: slice, v: bytes) -> None:
        if self.left == 0:
            raise Killed
        self.left -= 1
        self.data[k] = v


def fresh() -> tuple[bytearray, Ledger]:
    data = bytearray(SHAPE.nbytes)
    return data, Ledger(memoryview(data), SHAPE)


def test_an_entry_reads_back_as_written():
    data, ledger = fresh()
    ledger.begin(1, "req-1", [5, 6, 7], blocks=[1])
    ledger.record(1, [5, 6, 7, 8, 9], 4, {0: 1234}, 0)
    e = Ledger(memoryview(data), SHAPE).read(1)
    assert isinstance(e, Entry)
    assert (e.tokens, e.kv_valid, e.blocks, e.fingerprints, e.n_prompt) == (
        [5, 6, 7, 8, 9], 4, [1], [1234], 3)
    assert Ledger(memoryview(data), SHAPE).find("req-1") == (1, e)
    assert ledger.find("req-2") is KeptKVOutcome.NO_ENTRY
    assert ledger.read(0) is None


def test_a_writer_killed_at_any_store_leaves_the_previous_or_the_next_entry():
    tokens = list(range(10, 30))
    steps = [(tokens[:9], 8, {0: 11, 1: 12}, 0), (tokens[:10], 9, {}, 77),
             (tokens[:13], 12, {2: 13}, 0)]
    for step in range(1, len(steps)):
        for n in range(12):
            data, ledger = fresh()
            ledger.begin(0, "req", tokens[:8], blocks=[0])
            for s in steps[:step]:
                ledger.record(0, *s)
            before = ledger.read(0)
            dying = Ledger(DiesAfter(data, n), SHAPE)  # type: ignore[arg-type]
            dying._w = ledger._w
            with contextlib.suppress(Killed):
                dying.record(0, *steps[step])
            after = Ledger(memoryview(data), SHAPE).read(0)
            assert isinstance(after, Entry), (step, n)
            assert isinstance(before, Entry)
            want_new = steps[step]
            assert (after.tokens, after.kv_valid) in (
                (before.tokens, before.kv_valid), (want_new[0], want_new[1])), (step, n)


def test_a_torn_header_is_treated_as_absent_and_named_torn():
    data, ledger = fresh()
    ledger.begin(0, "req", [1, 2, 3], blocks=[0])
    ledger.record(0, [1, 2, 3, 4], 3, {}, 5)
    # Both copies garbled (the newest and the one before it).
    for copy in (0, 1):
        at = copy * 128 + 20
        data[at:at + 4] = b"\xff\xff\xff\xff"
    assert isinstance(ledger.read(0), Torn)
    assert ledger.find("req") is KeptKVOutcome.TORN


def test_recorded_tokens_changed_under_the_entry_make_it_torn():
    data, ledger = fresh()
    ledger.begin(0, "req", [1, 2, 3], blocks=[0])
    ledger.record(0, [1, 2, 3, 4], 3, {}, 5)
    tokens_at = 2 * 128
    data[tokens_at:tokens_at + 4] = (99).to_bytes(4, "little")
    assert isinstance(ledger.read(0), Torn)


def test_a_new_request_in_the_entry_leaves_nothing_of_the_old_one():
    _, ledger = fresh()
    ledger.begin(0, "old", [1, 2, 3], blocks=[0])
    ledger.record(0, [1, 2, 3, 4], 3, {}, 5)
    ledger.begin(0, "new", [7], blocks=[0])
    assert ledger.find("old") is KeptKVOutcome.NO_ENTRY
    e = ledger.read(0)
    assert isinstance(e, Entry) and e.tokens == [7] and e.kv_valid == 0


def test_fingerprints_follow_the_bits_of_every_layer_and_position():
    pool = torch.randn(2, 2, 3, 2, 32, 4)
    fps = kv_fingerprints(pool, 1, 0, 30, 4)
    assert len(fps) == 8  # seven full blocks and the last two positions
    assert kv_fingerprints(pool.clone(), 1, 0, 30, 4) == fps
    assert kv_fingerprints(pool, 1, 8, 12, 4) == [fps[2]]
    pool[1, 1, 1, 0, 9, 2] += 1.0  # one value of one layer's V at position 9
    changed = kv_fingerprints(pool, 1, 0, 30, 4)
    assert [i for i, (a, b) in enumerate(zip(fps, changed, strict=True)) if a != b] == [2]
    pool[0, 0, 0, 0, 0, 0] = 0.0  # another slot: not this slot's business
    assert kv_fingerprints(pool, 1, 0, 30, 4) == changed


def test_occupied_lists_torn_entries_first_then_the_least_recently_written():
    shape = LedgerShape(entries=4, max_tokens=64, max_blocks=1, fp_block=4)
    data = bytearray(shape.nbytes)
    first = Ledger(memoryview(data), shape)
    for slot in (3, 0, 2):
        first.begin(slot, f"req-{slot}", [5, 6], [slot])
    first.record(3, [5, 6, 7], 2, {}, 0)  # 3 began first but was written last
    # The next life continues the order: what it writes is newer than all of the above.
    later = Ledger(memoryview(data), shape)
    assert later.occupied() == [0, 2, 3]
    later.begin(0, "req-new", [9], [0])
    assert later.occupied() == [2, 3, 0]
    for copy in (0, 1):  # tear entry 2: no resume can claim it, so it goes first
        at = 2 * shape.entry_bytes + copy * HEADER_BYTES + 20
        data[at:at + 4] = b"\xff\xff\xff\xff"
    assert isinstance(later.read(2), Torn)
    assert Ledger(memoryview(data), shape).occupied() == [2, 3, 0]
