"""kvtier.ready_index (and the KeyTable under it) against a dict, and PackedKeys.

Random sets and unsets over a small table (so probe runs collide and wrap),
applied at random moments; every lookup, key by key and batched, must
give what the dict says. The store's use of the index is checked in
test_store_random.py."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvtier.keys import KEY_BYTES, PackedKeys
from kvtier.ready_index import ReadyIndex
from kvtier.tier import key_table


def key_array(keys) -> np.ndarray | None:  # noqa: ANN001 - a sequence of bytes, or PackedKeys
    """``keys`` as an (n, 2) "<u8" array of their halves, or None when one is not 16 bytes."""
    array = getattr(keys, "array", None)
    if array is not None:
        return array()
    joined = b"".join(keys)
    if len(joined) != KEY_BYTES * len(keys):
        return None
    return np.frombuffer(joined, dtype="<u8").reshape(-1, 2)


def K(i: int) -> bytes:
    return i.to_bytes(16, "little")


def leading_by_dict(model: dict[bytes, int], keys: list[bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in model:
        n += 1
    return n


def random_change(rng: random.Random, x: float, ix: ReadyIndex, model: dict[bytes, int], keys: list[bytes],
                  num_slots: int) -> None:
    """Below 0.45, set a key not in ``model`` at a free slot (if any);
    else unset one (a key never set is passed over); ``model`` follows."""
    if x < 0.45:
        key = rng.choice(keys)
        free = sorted(set(range(num_slots)) - set(model.values()))
        if key not in model and free:
            model[key] = rng.choice(free)
            ix.set(key, model[key])
    else:
        key = rng.choice(list(model) or keys)
        model.pop(key, None)
        ix.unset(key)


@pytest.mark.parametrize("seed", range(4))
def test_random_sets_and_unsets_match_a_dict(seed: int) -> None:
    rng = random.Random(seed)
    num_slots = 48
    ix = ReadyIndex(num_slots)
    model: dict[bytes, int] = {}  # key -> slot, one key a slot, as the store keeps it
    keys = [K(i) for i in range(200)] + [os.urandom(16) for _ in range(40)]
    for step in range(3000):
        x = rng.random()
        if x < 0.8:
            random_change(rng, x, ix, model, keys, num_slots)
        elif x < 0.9:
            start = rng.randrange(len(keys))
            ask = [rng.choice(list(model)) for _ in range(rng.randrange(0, 40))] if model else []
            ask += keys[start : start + rng.randrange(1, 30)]
            n, slots = ix.leading(key_array(ask))
            assert n == leading_by_dict(model, ask), f"step {step}"
            assert slots.tolist() == [model[k] for k in ask[:n]], f"step {step}"
            assert ix.keys_of(slots) == ask[:n]
            found = ix._find_array(key_array(ask))
            assert found.tolist() == [model.get(k, -1) for k in ask], f"step {step}"
        elif x < 0.95:
            ix.flush()
        else:
            assert ix.held() == model, f"step {step}"
            assert ix.count() == len(model)
    assert ix.held() == model


def test_a_slot_given_to_another_key_is_taken_from_the_first() -> None:
    # The store unsets a key before its slot goes to another; if it did not,
    # the slot would answer for the new key only, never for both.
    ix = ReadyIndex(8)
    ix.set(K(1), 3)
    ix.flush()
    ix.set(K(2), 3)
    assert ix.held() == {K(2): 3}
    assert ix.leading(key_array([K(1)]))[0] == 0


def test_only_the_last_change_of_a_key_counts() -> None:
    ix = ReadyIndex(8)
    ix.set(K(1), 0)
    ix.unset(K(1))
    ix.set(K(2), 1)
    ix.set(K(2), 5)  # moved before any lookup
    assert ix.held() == {K(2): 5}
    ix.unset(K(2))
    ix.set(K(2), 5)
    assert ix.held() == {K(2): 5}


def test_batched_lookup_walks_long_runs_window_by_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Many keys with one home: one probe run, longer than one window of the
    # batched walk (key_table._WINDOW), whatever the window; a key absent
    # ends its walk at the run's end only.
    ix = ReadyIndex(256)
    home = ix.bucket(K(0))
    same = [k for k in (K(i) for i in range(200_000)) if ix.bucket(k) == home][:40]
    assert len(same) == 40
    for slot, key in enumerate(same):
        ix.set(key, slot)
    ix.flush()
    missing = next(k for k in (K(i) for i in range(200_000, 400_000)) if ix.bucket(k) == home)
    ask = same + [missing]
    for window in (1, 3, len(key_table._WINDOW), 64):
        monkeypatch.setattr(key_table, "_WINDOW", np.arange(1, window + 1))
        assert ix._find_array(key_array(ask)).tolist() == list(range(40)) + [-1]
        assert [ix._find(k)[1] for k in ask] == list(range(40)) + [-1]
        assert ix.leading(key_array(ask))[0] == 40
        assert ix.leading(key_array([missing] + same))[0] == 0


def test_a_key_asked_where_its_home_is_empty_is_absent_though_the_last_slot_kept_it() -> None:
    # An empty position reads the last slot's key in the batched lookup: a
    # key that left the table but whose bytes the last slot still holds
    # must come out absent, not at slot -1 nor at any other.
    ix = ReadyIndex(8)
    last, other = K(7), K(3)
    ix.set(last, 7)
    ix.set(other, 2)
    ix.flush()
    assert ix._find_array(key_array([last, other])).tolist() == [7, 2]
    ix.unset(last)
    ix.flush()
    assert bytes(ix._key_bytes[7 * KEY_BYTES :]) == last  # the bytes stay in the slot
    assert ix._find_array(key_array([last, other])).tolist() == [-1, 2]
    assert ix.leading(key_array([other, last]))[0] == 1
    assert ix.held() == {other: 2}


def test_a_table_of_no_slots_finds_nothing() -> None:
    ix = ReadyIndex(0)
    assert ix.leading(key_array([K(1), K(2)]))[0] == 0
    assert ix.leading(np.zeros((0, 2), dtype="<u8"))[0] == 0


def test_keys_that_are_not_16_bytes_have_no_array() -> None:
    assert key_array([K(1), b"short"]) is None
    assert key_array([]).shape == (0, 2)


def test_packed_keys_read_as_a_list() -> None:
    keys = [K(i) for i in range(10)] + [b"\x00" * 16, b"\x01" + b"\x00" * 15]  # trailing zeros kept
    packed = PackedKeys(b"".join(keys))
    assert len(packed) == 12
    assert list(packed) == keys
    assert packed[3] == keys[3]
    assert packed[-1] == keys[-1]
    assert list(packed[2:5]) == keys[2:5]
    assert list(packed[5:2]) == []
    assert packed[::2] == keys[::2]
    assert (key_array(packed) == key_array(keys)).all()
    assert list(PackedKeys(packed.blob).iter_from(9)) == keys[9:]  # before the list is made
    assert list(packed.iter_from(9)) == keys[9:]  # and after
    assert list(packed.iter_from(12)) == []
    with pytest.raises(ValueError, match="whole number of 16-byte keys"):
        PackedKeys(b"x" * 17)
