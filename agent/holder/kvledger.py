"""A crash-consistent ledger of which KV blocks hold which request's tokens.

It lives in memory the holder keeps (a host region), so an engine that dies leaves it to
its successor along with the KV pool itself. Engine-neutral: an entry is a request id, a
block table, the token ids recorded and how many positions have their KV written; the
reference engine uses one entry per KV slot (a block table of one slot), a paged engine
would list its blocks.

Write-ahead rule: `record` is called only after the KV of every position it declares
valid is written (on a GPU, synchronised: the step's logits reached the host), and it
writes token ids and block fingerprints before the header that declares them. Headers
come in two copies written alternately, each with a sequence number and a CRC over
itself and every byte it vouches for, so a writer killed mid-write leaves the previous
header valid. Every header also carries a ledger-wide stamp, larger on each write, so the
entries a dead engine left can be given away oldest first. A header whose CRC fails is
*torn*; an entry whose request id, tokens or KV fingerprints do not match what a resume
expects is treated as absent.

Example::

    ledger = Ledger(buf, LedgerShape(entries=8, max_tokens=2048, max_blocks=1))
    ledger.begin(3, "req-1", prompt, blocks=[3])
    ledger.record(3, tokens, kv_valid=len(prompt), fingerprints={0: fp0}, partial=fp1)
    entry = ledger.read(3)          # Entry, or Torn / None
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from enum import StrEnum

# Headers between the front and an engine that keeps KV across crashes (other engines
# ignore them). The front names every streamed request, with the same name on every
# engine it goes to; on a continuation it adds RESUME_HEADER (how many tokens the client
# has). The engine answers a continuation with KV_HEADER (a KeptKVOutcome) and
# KV_KEPT_HEADER (the positions whose KV it did not compute again).
REQUEST_HEADER = "X-Pitstop-Request"
RESUME_HEADER = "X-Pitstop-Resume"
KV_HEADER = "X-Pitstop-KV"
KV_KEPT_HEADER = "X-Pitstop-KV-Kept"

MAGIC = b"PKV2"  # PKV1 headers had no stamp: read as empty, not as torn
# magic, seq, request key, n_prompt, kv_valid, n_tokens, n_blocks, fp_block, partial fp,
# stamp, then the CRC of all of it (the CRC field as zero) and the arrays it covers.
_HEADER = struct.Struct("<4sQ32sIIIIIqQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = 128  # each copy, padded: room to grow without moving the arrays


class KeptKVOutcome(StrEnum):
    """What a resumed request found: kept KV, or why it fell back to a full re-prefill."""

    KEPT = "kept"                      # continued from the ledger's last valid position
    NOT_HELD = "not_held"              # the engine's KV pool is not in the holder
    NO_ENTRY = "no_entry"              # no ledger entry for the request (finished, dropped)
    TORN = "torn"                      # the entry's header fails its checksum
    TOKENS_DIFFER = "tokens_differ"    # the ledger's tokens are not the ones the client got
    KV_CHANGED = "kv_changed"          # the KV blocks' fingerprints changed since written
    SLOT_BUSY = "slot_busy"            # the entry's blocks are in use by another request
    NOT_REPORTED = "not_reported"      # the engine said nothing (not a kept-KV engine)


def request_key(request_id: str) -> bytes:
    """32 bytes naming a request in the ledger, whatever the id's length."""
    return hashlib.blake2b(request_id.encode(), digest_size=32).digest()


@dataclass(frozen=True)
class LedgerShape:
    entries: int
    max_tokens: int
    max_blocks: int
    # Positions per KV fingerprint: a full block's fingerprint is written once.
    fp_block: int = 16

    @property
    def fp_blocks(self) -> int:
        return -(-self.max_tokens // self.fp_block)

    @property
    def entry_bytes(self) -> int:
        n = 2 * HEADER_BYTES + 4 * self.max_tokens + 4 * self.max_blocks + 8 * self.fp_blocks
        return -(-n // 64) * 64

    @property
    def nbytes(self) -> int:
        return self.entries * self.entry_bytes


@dataclass(frozen=True)
class Entry:
    """A valid ledger entry: positions `0..kv_valid-1` have KV, `tokens` are recorded."""

    key: bytes
    seq: int
    n_prompt: int
    kv_valid: int
    tokens: list[int]
    blocks: list[int]
    fp_block: int
    fingerprints: list[int]  # one per full block below kv_valid
    partial: int             # of positions [len(fingerprints) * fp_block, kv_valid)
    stamp: int = 0           # ledger-wide write order: larger is written later


@dataclass(frozen=True)
class Torn:
    """An entry whose header copies were written (magic present) but none checks out."""


@dataclass
class _Writer:
    seq: int = 0
    n_tokens: int = 0
    n_blocks: int = 0
    n_fps: int = 0
    key: bytes = b""
    n_prompt: int = 0


class Ledger:
    """Entries over a writable buffer of `shape.nbytes` bytes (a mapped holder region)."""

    def __init__(self, buf: memoryview, shape: LedgerShape) -> None:
        if len(buf) < shape.nbytes:
            raise ValueError(f"a ledger of {shape} needs {shape.nbytes} bytes, got {len(buf)}")
        self.buf = buf
        self.shape = shape
        self._w: dict[int, _Writer] = {}
        # Continues the order an earlier life wrote in: its entries stay older than ours.
        self._stamp = max((e.stamp for i in range(shape.entries)
                           if isinstance(e := self.read(i), Entry)), default=0)

    # --- where things are ---------------------------------------------------------------
    def _base(self, entry: int) -> int:
        if not 0 <= entry < self.shape.entries:
            raise IndexError(f"ledger entry {entry} outside 0..{self.shape.entries - 1}")
        return entry * self.shape.entry_bytes

    def _tokens_at(self, entry: int) -> int:
        return self._base(entry) + 2 * HEADER_BYTES

    def _blocks_at(self, entry: int) -> int:
        return self._tokens_at(entry) + 4 * self.shape.max_tokens

    def _fps_at(self, entry: int) -> int:
        return self._blocks_at(entry) + 4 * self.shape.max_blocks

    # --- writing ------------------------------------------------------------------------
    def clear(self, entry: int) -> None:
        """The entry holds nothing (its request finished, or its blocks go to another)."""
        b = self._base(entry)
        self.buf[b:b + 2 * HEADER_BYTES] = bytes(2 * HEADER_BYTES)
        self._w.pop(entry, None)

    def begin(self, entry: int, request_id: str, prompt: list[int], blocks: list[int]) -> None:
        """A new request takes the entry: its prompt ids recorded, no KV valid yet."""
        self.clear(entry)  # first: the old headers must not vouch for the new arrays
        self._w[entry] = _Writer(key=request_key(request_id), n_prompt=len(prompt))
        self.record(entry, prompt, 0, {}, 0, blocks)

    def record(self, entry: int, tokens: list[int], kv_valid: int,
               fingerprints: dict[int, int], partial: int,
               blocks: list[int] | None = None) -> None:
        """Declare `tokens` recorded and positions below `kv_valid` written.

        Only ever grows: `tokens` extends what was recorded, `fingerprints` (full block
        index -> fingerprint) are the blocks completed since the last call, `partial` is
        the fingerprint of the last, incomplete block.
        """
        w = self._w[entry]
        s = self.shape
        if len(tokens) > s.max_tokens or kv_valid > len(tokens):
            raise ValueError(f"{len(tokens)} tokens, {kv_valid} valid: outside the ledger")
        t0 = self._tokens_at(entry)
        if len(tokens) > w.n_tokens:
            new = tokens[w.n_tokens:]
            self.buf[t0 + 4 * w.n_tokens:t0 + 4 * len(tokens)] = struct.pack(
                f"<{len(new)}i", *new)
            w.n_tokens = len(tokens)
        if blocks is not None:
            b0 = self._blocks_at(entry)
            self.buf[b0:b0 + 4 * len(blocks)] = struct.pack(f"<{len(blocks)}i", *blocks)
            w.n_blocks = len(blocks)
        f0 = self._fps_at(entry)
        for k, fp in sorted(fingerprints.items()):
            self.buf[f0 + 8 * k:f0 + 8 * k + 8] = struct.pack("<q", fp)
        w.n_fps = kv_valid // s.fp_block
        w.seq += 1
        self._stamp += 1
        head = _HEADER.pack(MAGIC, w.seq, w.key, w.n_prompt, kv_valid, w.n_tokens, w.n_blocks,
                            s.fp_block, partial, self._stamp)
        crc = self._crc(entry, head, w.n_tokens, w.n_blocks, w.n_fps)
        at = self._base(entry) + (w.seq % 2) * HEADER_BYTES
        self.buf[at:at + _HEADER.size + _CRC.size] = head + _CRC.pack(crc)

    def _crc(self, entry: int, head: bytes, n_tokens: int, n_blocks: int, n_fps: int) -> int:
        t0, b0, f0 = self._tokens_at(entry), self._blocks_at(entry), self._fps_at(entry)
        crc = zlib.crc32(head)
        crc = zlib.crc32(self.buf[t0:t0 + 4 * n_tokens], crc)
        crc = zlib.crc32(self.buf[b0:b0 + 4 * n_blocks], crc)
        return zlib.crc32(self.buf[f0:f0 + 8 * n_fps], crc)

    # --- reading ------------------------------------------------------------------------
    def read(self, entry: int) -> Entry | Torn | None:
        """The newest valid header's entry; Torn when headers exist but none is valid;
        None when the entry is empty."""
        best: Entry | None = None
        written = False
        base = self._base(entry)
        for copy in (0, 1):
            at = base + copy * HEADER_BYTES
            raw = bytes(self.buf[at:at + _HEADER.size + _CRC.size])
            (magic, seq, key, n_prompt, kv_valid, n_tokens, n_blocks, fp_block, partial,
             stamp) = _HEADER.unpack(raw[:_HEADER.size])
            if magic != MAGIC:
                continue
            written = True
            s = self.shape
            if (n_tokens > s.max_tokens or n_blocks > s.max_blocks or kv_valid > n_tokens
                    or fp_block != s.fp_block or n_prompt > n_tokens):
                continue
            n_fps = kv_valid // fp_block
            (crc,) = _CRC.unpack(raw[_HEADER.size:])
            if self._crc(entry, raw[:_HEADER.size], n_tokens, n_blocks, n_fps) != crc:
                continue
            if best is not None and best.seq >= seq:
                continue
            t0, b0, f0 = self._tokens_at(entry), self._blocks_at(entry), self._fps_at(entry)
            best = Entry(
                key=key, seq=seq, n_prompt=n_prompt, kv_valid=kv_valid,
                tokens=list(struct.unpack(f"<{n_tokens}i", self.buf[t0:t0 + 4 * n_tokens])),
                blocks=list(struct.unpack(f"<{n_blocks}i", self.buf[b0:b0 + 4 * n_blocks])),
                fp_block=fp_block,
                fingerprints=list(struct.unpack(f"<{n_fps}q", self.buf[f0:f0 + 8 * n_fps])),
                partial=partial, stamp=stamp)
        if best is not None:
            return best
        return Torn() if written else None

    def find(self, request_id: str) -> tuple[int, Entry] | KeptKVOutcome:
        """The entry of `request_id`, or NO_ENTRY / TORN (when some entry is torn: it
        may have been this request's, and its name cannot be trusted either)."""
        key = request_key(request_id)
        torn = False
        for i in range(self.shape.entries):
            e = self.read(i)
            if isinstance(e, Torn):
                torn = True
            elif e is not None and e.key == key:
                return i, e
        return KeptKVOutcome.TORN if torn else KeptKVOutcome.NO_ENTRY

    def occupied(self) -> list[int]:
        """Entries that hold something (valid or torn): what a previous life left, oldest
        first, so the one given away first is the least likely to be resumed. Torn
        entries come first (no resume can claim them), then by their last write: the
        entries of the life that died last, whose clients are resuming now, come last."""
        found = [(i, e) for i in range(self.shape.entries) if (e := self.read(i)) is not None]
        found.sort(key=lambda ie: (-1, ie[0]) if isinstance(ie[1], Torn) else
                   (ie[1].stamp, ie[0]))
        return [i for i, _ in found]

    def adopt(self, entry: int, e: Entry, kept: int) -> None:
        """Continue an entry a previous life left, from its first `kept` positions: what
        it recorded beyond them is written over by the continuation."""
        self._w[entry] = _Writer(seq=e.seq, n_tokens=kept, n_blocks=len(e.blocks),
                                 n_fps=kept // e.fp_block, key=e.key, n_prompt=e.n_prompt)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
