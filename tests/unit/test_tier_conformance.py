"""What every tier must do, run against each: DramTier (shared memory) and SsdTier (direct I/O files).

The tiers differ in how a block gets in and out (a DRAM slot is written in
place and sealed; an SSD slot is written and read through an aligned buffer
with a record the index keeps), so each gets a small test-only adapter with
the same four operations, and the tests below are written once against it.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Iterator

import pytest
import torch
import xxhash

from kvtier.tier import DramTier
from kvtier.tier.dram import checksum
from kvtier.tier.ssd import BlockRecord
from tests.unit.conftest import PAGE, ssd_offsets

SLOT = 3 * PAGE
SLOTS = 6


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(key: bytes, version: int = 0) -> bytes:
    """``SLOT`` bytes that differ in every version of every key."""
    return hashlib.shake_256(key + version.to_bytes(4, "little")).digest(SLOT)


class DramAdapter:
    """put = write the rank view and seal; get = verify, then copy out."""

    def __init__(self, tier: DramTier) -> None:
        self.tier = tier
        self.num_slots = tier.num_slots

    def put(self, slot: int, key: bytes, data: bytes) -> None:
        view = self.tier.rank_view(slot, 0)
        view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.tier.seal(slot, key, 0, checksum(view, key))

    def get(self, slot: int, key: bytes) -> bytes | None:
        if not self.tier.verify(slot, key, 0):
            return None
        return bytes(self.tier.rank_view(slot, 0).numpy())

    def corrupt(self, slot: int, offset: int) -> None:
        self.tier.rank_view(slot, 0)[offset] ^= 0x01


class SsdAdapter:
    """put = write through an aligned buffer; get = restart the tier and read
    the slot with the record that recovery found in its header. On SSD the
    headers on disk are the index (the store keeps them in memory while it
    runs), so what a slot holds is what a restart says it holds."""

    def __init__(self, reopen) -> None:
        self._reopen = reopen
        self.tier, _ = reopen()
        self.num_slots = self.tier.num_slots
        self._locs = self.tier.locations()
        self._written: set[int] = set()
        self._buf = mmap.mmap(-1, SLOT)  # page aligned: an O_DIRECT buffer

    def put(self, slot: int, key: bytes, data: bytes) -> None:
        self._buf[:] = data
        rec = BlockRecord(key, self.tier.next_seq(), xxhash.xxh3_64_intdigest(data))
        reused = [self._locs[slot]] if slot in self._written else []
        self.tier.write([(self._locs[slot], rec, memoryview(self._buf))], reused)
        self._written.add(slot)

    def get(self, slot: int, key: bytes) -> bytes | None:
        self.tier.close()
        self.tier, recovered = self._reopen()
        rec = dict(recovered).get(self._locs[slot])
        if rec is None or rec.key != key:
            return None
        self._buf[:] = bytes(SLOT)  # nothing left over from a put
        if not self.tier.read(self._locs[slot], rec, memoryview(self._buf)):
            return None
        return bytes(self._buf)

    def corrupt(self, slot: int, offset: int) -> None:
        loc = self._locs[slot]
        with open(self.tier.paths[loc.path_index], "r+b") as f:
            f.seek(ssd_offsets(SLOT, loc.slot, SLOTS // 2)[1] + offset)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))


Adapter = DramAdapter | SsdAdapter


@pytest.fixture(params=["dram", "ssd"])
def tier(request, make_tier, capacity_for, make_ssd) -> Iterator[Adapter]:
    if request.param == "dram":
        yield DramAdapter(make_tier(capacity_for(SLOTS, SLOT), SLOT))
    else:
        adapter = SsdAdapter(lambda: make_ssd(SLOTS // 2, SLOT, num_paths=2))
        yield adapter
        adapter.tier.close()


def test_geometry(tier: Adapter) -> None:
    assert tier.num_slots == SLOTS


def test_round_trip(tier: Adapter) -> None:
    tier.put(2, K(1), payload(K(1)))
    assert tier.get(2, K(1)) == payload(K(1))


def test_empty_slot_is_a_miss(tier: Adapter) -> None:
    assert tier.get(0, K(1)) is None
    assert tier.get(0, bytes(16)) is None


def test_wrong_key_is_a_miss(tier: Adapter) -> None:
    tier.put(0, K(1), payload(K(1)))
    assert tier.get(0, K(2)) is None
    assert tier.get(0, K(1)) == payload(K(1))


@pytest.mark.parametrize("offset", [0, SLOT // 2, SLOT - 1])
def test_corrupt_byte_is_a_miss(tier: Adapter, offset: int) -> None:
    tier.put(1, K(1), payload(K(1)))
    tier.put(2, K(2), payload(K(2)))
    tier.corrupt(1, offset)
    assert tier.get(1, K(1)) is None
    assert tier.get(2, K(2)) == payload(K(2))  # the neighbour is untouched


def test_overwrite_with_another_key(tier: Adapter) -> None:
    tier.put(3, K(1), payload(K(1)))
    tier.put(3, K(2), payload(K(2)))
    assert tier.get(3, K(1)) is None
    assert tier.get(3, K(2)) == payload(K(2))


def test_overwrite_with_a_new_version_of_the_key(tier: Adapter) -> None:
    tier.put(3, K(1), payload(K(1), 0))
    tier.put(3, K(1), payload(K(1), 1))
    assert tier.get(3, K(1)) == payload(K(1), 1)


def test_every_slot_is_independent(tier: Adapter) -> None:
    for slot in range(tier.num_slots):
        tier.put(slot, K(slot), payload(K(slot)))
    for slot in range(tier.num_slots):
        assert tier.get(slot, K(slot)) == payload(K(slot))
    # Rewriting one slot leaves the others alone.
    tier.put(0, K(99), payload(K(99)))
    for slot in range(1, tier.num_slots):
        assert tier.get(slot, K(slot)) == payload(K(slot))


@pytest.mark.parametrize("fill", [b"\x00", b"\xff", None], ids=["zeros", "ones", "ramp"])
def test_bit_exact_across_the_whole_slot(tier: Adapter, fill: bytes | None) -> None:
    data = fill * SLOT if fill is not None else bytes(i % 251 for i in range(SLOT))
    tier.put(4, K(4), data)
    tier.put(5, K(5), payload(K(5)))  # a different neighbour on each side of the first/last byte
    tier.put(3, K(3), payload(K(3)))
    got = tier.get(4, K(4))
    assert got is not None and len(got) == SLOT
    assert got == data

