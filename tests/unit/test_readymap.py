"""kvtier.pool.readymap: the service's ready index in shared memory, read by instances without a call.

A writer (the store's ReadyIndex over the file's memory, as the meta
service keeps it) and a reader (another mapping of the file, as an
instance has it) against a dict; the seqlock that makes a reader count
again, or give up, while the writer changes the table; the file's checks.
The service and its clients over it: test_pool_service.py."""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.pool.readymap import ReadyMap
from kvtier.ready_index import ReadyIndex, memory_bytes
from kvtier.tier.key_table import KeyTable
from tests.unit.test_ready_index import K, leading_by_dict, random_change


def halves(keys: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)


def count(reader: ReadyMap, keys: list[bytes]) -> int | None:
    run = reader.leading(halves(keys))
    return None if run is None else run[0]


@pytest.fixture
def pair(tmp_path: Path):  # noqa: ANN201 - (writer's map, its index, a reader's map)
    made = ReadyMap.create(str(tmp_path / "kvtier-poolready-x"), 48)
    index = ReadyIndex(48, made.memory)
    reader = ReadyMap.attach(made.path)
    yield made, index, reader
    reader.close()
    made.close()


@pytest.mark.parametrize("seed", range(3))
def test_a_reader_of_the_file_counts_what_the_writer_s_index_holds(pair, seed: int) -> None:  # noqa: ANN001
    _, index, reader = pair
    rng = random.Random(seed)
    model: dict[bytes, int] = {}
    keys = [K(i) for i in range(150)] + [os.urandom(16) for _ in range(30)]
    for step in range(1500):
        x = rng.random()
        if x < 0.8:
            random_change(rng, x, index, model, keys, 48)
        else:
            index.flush()  # what a reader sees: the changes applied
            ask = [rng.choice(list(model)) for _ in range(rng.randrange(0, 30))] if model else []
            ask += keys[rng.randrange(len(keys)):][: rng.randrange(1, 20)]
            run = reader.leading(halves(ask))
            assert run is not None
            n = leading_by_dict(model, ask)
            assert run[0] == n and run[1].tolist() == [model[k] for k in ask[:n]], f"step {step}"


def test_a_count_made_while_the_table_changed_is_made_again(pair, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    _, index, reader = pair
    ks = [K(i) for i in range(10)]
    for slot, key in enumerate(ks):
        index.set(key, slot)
    index.flush()
    counts: list[int] = []
    real = KeyTable.run_of

    def changing(table: KeyTable, want: np.ndarray) -> tuple[int, np.ndarray]:
        got = real(table, want)
        counts.append(got[0])
        if len(counts) == 1:  # a flush runs whole during the first count
            index.unset(ks[4])
            index.flush()
        return got

    monkeypatch.setattr(KeyTable, "run_of", changing)
    assert count(reader, ks) == 4  # the second count, after the change
    assert counts == [10, 4]


def test_a_table_that_changes_under_every_count_or_is_being_changed_sends_the_reader_to_the_service(
        pair, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    made, index, reader = pair
    index.set(K(1), 1)
    index.flush()
    real = KeyTable.run_of

    def always(table: KeyTable, want: np.ndarray) -> tuple[int, np.ndarray]:
        index.set(K(2), 2)
        index.flush()
        index.unset(K(2))
        index.flush()
        return real(table, want)

    with monkeypatch.context() as m:
        m.setattr(KeyTable, "run_of", always)
        assert count(reader, [K(1)]) is None
    assert count(reader, [K(1)]) == 1
    index._seq += 1  # odd: a flush in progress (or one that failed on the way)
    assert count(reader, [K(1)]) is None
    index._seq += 1
    assert count(reader, [K(1)]) == 1
    assert made.memory[8:16].tobytes() == int(index._seq[0]).to_bytes(8, "little")  # the header's number


def test_the_file_is_the_service_s_own_and_goes_with_it(tmp_path: Path) -> None:
    made = ReadyMap.create(str(tmp_path / "kvtier-poolready-y"), 100)
    path = Path(made.path)
    assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_size == memory_bytes(100)
    with pytest.raises(FileExistsError):
        ReadyMap.create(made.path, 100)
    index = ReadyIndex(100, made.memory)
    index.set(K(5), 5)
    index.flush()
    reader = ReadyMap.attach(made.path)
    assert reader.holds(K(5)) and not reader.holds(K(6))
    reader.close()
    assert path.exists() and reader._mm.closed  # a reader's close unmaps, and leaves the file
    assert not reader.holds(K(5)) and reader.leading(halves([K(5)])) is None  # closed: the service is asked
    made.close()
    assert not path.exists() and not made._mm.closed  # the store's arrays still use it: mapped until they go
    del index
    gc.collect()


def test_a_file_that_is_no_ready_index_is_refused_by_name(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="short is not a ready index"):
        ReadyMap.attach(str(short))
    other = tmp_path / "other"
    other.write_bytes(b"kvtother" + b"\0" * (memory_bytes(8) - 8))
    with pytest.raises(ValueError, match="other is not a ready index"):
        ReadyMap.attach(str(other))
    made = ReadyMap.create(str(tmp_path / "kvtier-poolready-z"), 8)
    ReadyIndex(8, made.memory)
    with open(made.path, "ab") as f:  # a size that is not the header's
        f.write(b"\0" * 64)
    with pytest.raises(ValueError, match="not one laid out by this kvtier version"):
        ReadyMap.attach(made.path)
    with pytest.raises(ValueError, match="hold no ready index"):
        ReadyIndex(1000, made.memory)
    made.close()


def test_a_reader_never_takes_a_count_made_while_a_flush_changed_the_table(pair) -> None:  # noqa: ANN001
    # The writer flushes in one thread, the reader counts in another, the
    # interpreter switching between them every few bytecodes. Keys that
    # are in the table before and after every flush must be counted whole
    # in every count the reader keeps; a count over a table half changed
    # (a flush takes a key set again out and puts it back, and moves keys
    # that stay into the holes others leave) would stop short of them.
    _, index, reader = pair
    stable = [K(i) for i in range(8)]
    for slot, key in enumerate(stable):
        index.set(key, slot)
    index.flush()
    churn = [K(1000 + i) for i in range(30)]
    stop = threading.Event()
    flushes = [0]

    def write() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            for slot, key in enumerate(rng.sample(churn, 20), start=8):
                index.set(key, slot)
            for slot, key in enumerate(stable):  # set again where it is: out of the table and back in one flush
                index.set(key, slot)
            index.flush()
            for key in churn:
                index.unset(key)
            index.flush()
            flushes[0] += 2

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    writer = threading.Thread(target=write)
    writer.start()
    kept = asked = 0
    try:
        want = halves(stable)
        while (kept < 300 or flushes[0] < 200) and asked < 200_000:
            asked += 1
            run = reader.leading(want)
            if run is not None:
                kept += 1
                assert run[0] == len(stable) and run[1].tolist() == list(range(8))
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(old)
    assert kept >= 300 and flushes[0] >= 200
