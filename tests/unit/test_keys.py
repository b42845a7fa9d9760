"""kvtier.keys: golden vectors and the properties of chained block keys.

The literals below pin the v3 encoding. If this test fails, every key in
every existing pool has changed: bump the namespace tag (``kvtier-ns-v3``)
instead of updating the literals. (v1 -> v2, issue 7: the namespace gained
``cache_dtype`` and ``model_dtype``; v2 -> v3: SHA-256 in place of xxh3,
which a tenant could collide on purpose; every key changed on purpose.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvtier.keys import KEY_BYTES, KeyNamespace, block_keys

NS = KeyNamespace(model="m", dtype="torch.bfloat16", layout="cpu", block_tokens=4)
TOKENS = list(range(10))

GOLDEN_SEED = "e93edd4e651a3c06692988184fa63803"
GOLDEN_KEYS = [
    "29aa19c86990671051223031561f3373",
    "73e31530c9dde1518fed582642fe2bff",
]
GOLDEN_FINGERPRINT = "ab520615b4194a24383b91ce2b6331a2"


def test_golden_vectors() -> None:
    assert NS.seed().hex() == GOLDEN_SEED
    keys = block_keys(NS.seed(), TOKENS, NS.block_tokens)
    assert [k.hex() for k in keys] == GOLDEN_KEYS
    assert all(len(k) == KEY_BYTES for k in keys)


def test_golden_vectors_follow_documented_encoding() -> None:
    """Rebuild the keys from the module docstring's recipe with hashlib alone."""
    ns_bytes = (b'{"block_tokens":4,"cache_dtype":"auto","dtype":"torch.bfloat16","layout":"cpu","model":"m",'
                b'"model_dtype":"","pp_rank":0,"pp_size":1,"tp_size":1}')
    assert NS.encode() == ns_bytes
    prev = hashlib.sha256(b"kvtier-ns-v3\0" + ns_bytes).digest()[:16]
    expected = []
    for b in range(2):
        raw = b"".join(t.to_bytes(4, "little", signed=True) for t in TOKENS[b * 4 : b * 4 + 4])
        prev = hashlib.sha256(prev + raw).digest()[:16]
        expected.append(prev.hex())
    assert expected == GOLDEN_KEYS


def test_input_types_agree() -> None:
    seed = NS.seed()
    as_list = block_keys(seed, TOKENS, 4)
    assert block_keys(seed, np.arange(10, dtype=np.int64), 4) == as_list
    assert block_keys(seed, tuple(TOKENS), 4) == as_list


def test_trailing_partial_block_has_no_key() -> None:
    seed = NS.seed()
    assert len(block_keys(seed, TOKENS, 4)) == 2
    assert block_keys(seed, TOKENS[:8], 4) == block_keys(seed, TOKENS, 4)
    assert len(block_keys(seed, TOKENS[:7], 4)) == 1
    assert block_keys(seed, TOKENS[:3], 4) == []
    assert block_keys(seed, [], 4) == []


@pytest.mark.parametrize("start", [1, 2, 3, 5])
def test_incremental_extension_equals_full(start: int) -> None:
    seed = NS.seed()
    tokens = list(range(100, 123))  # 5 full blocks of 4 and 3 spare tokens
    full = block_keys(seed, tokens, 4)
    assert len(full) == 5
    tail = block_keys(seed, tokens, 4, start=start, parent=full[start - 1])
    assert full[:start] + tail == full


def test_extension_past_the_end_is_empty() -> None:
    full = block_keys(NS.seed(), TOKENS, 4)
    assert block_keys(NS.seed(), TOKENS, 4, start=2, parent=full[1]) == []


def test_parent_start_mismatch_raises() -> None:
    seed = NS.seed()
    full = block_keys(seed, TOKENS, 4)
    with pytest.raises(ValueError):
        block_keys(seed, TOKENS, 4, start=1)  # parent missing
    with pytest.raises(ValueError):
        block_keys(seed, TOKENS, 4, start=0, parent=full[0])  # parent given at the head


@pytest.mark.parametrize(
    "change",
    [
        {"model": "m2"},
        {"dtype": "torch.float16"},
        {"layout": "flash"},
        {"block_tokens": 2},
        {"tp_size": 2},
        {"pp_size": 2},
        {"pp_rank": 1},
        {"cache_dtype": "fp8_e4m3"},
        {"model_dtype": "torch.float16"},
    ],
)
def test_every_namespace_field_changes_keys(change: dict) -> None:
    other = dataclasses.replace(NS, **change)
    assert other.seed() != NS.seed()
    # Same tokens, same block size for the hash: only the namespace differs.
    mine = block_keys(NS.seed(), TOKENS, 4)
    theirs = block_keys(other.seed(), TOKENS, 4)
    assert not set(mine) & set(theirs)


def test_key_names_the_whole_prefix() -> None:
    seed = NS.seed()
    tokens = list(range(16))
    base = block_keys(seed, tokens, 4)
    for pos in range(16):
        changed = list(tokens)
        changed[pos] += 1000
        keys = block_keys(seed, changed, 4)
        block = pos // 4
        assert keys[:block] == base[:block], pos  # earlier blocks keep their keys
        for i in range(block, 4):
            assert keys[i] != base[i], (pos, i)  # this block and every later one change


def test_same_block_tokens_after_different_prefixes_differ() -> None:
    seed = NS.seed()
    a = block_keys(seed, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = block_keys(seed, [5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


def test_tokens_above_int16_and_negative_are_distinct() -> None:
    seed = NS.seed()
    keys = {block_keys(seed, [t, 0, 0, 0], 4)[0] for t in (1, 65537, 1 << 30, -1)}
    assert len(keys) == 4


_CHILD = """
from kvtier.keys import KeyNamespace, block_keys
ns = KeyNamespace(model="m", dtype="torch.bfloat16", layout="cpu", block_tokens=4)
print(" ".join(k.hex() for k in block_keys(ns.seed(), list(range(10)), 4)))
"""


def test_stable_across_processes() -> None:
    outputs = set()
    for hashseed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                             capture_output=True, text=True, timeout=120)
        outputs.add(tuple(out.stdout.split()))
    assert outputs == {tuple(GOLDEN_KEYS)}


def test_fingerprint_golden_vector_follows_documented_recipe() -> None:
    """The layout fingerprint an SSD superblock keeps: xxh3-128 of the layout fields alone."""
    fields = (b'{"block_tokens":4,"cache_dtype":"auto","dtype":"torch.bfloat16","layout":"cpu",'
              b'"pp_size":1,"tp_size":1}')
    assert xxhash.xxh3_128_digest(b"kvtier-layout-v1\0" + fields).hex() == GOLDEN_FINGERPRINT
    assert NS.fingerprint().hex() == GOLDEN_FINGERPRINT
    assert len(NS.fingerprint()) == 16


@pytest.mark.parametrize("change", [{"dtype": "torch.float16"}, {"layout": "flash"}, {"block_tokens": 2},
                                    {"tp_size": 2}, {"pp_size": 2}, {"cache_dtype": "fp8_e5m2"}])
def test_every_layout_field_changes_the_fingerprint(change: dict) -> None:
    assert dataclasses.replace(NS, **change).fingerprint() != NS.fingerprint()


@pytest.mark.parametrize("change", [{"model": "m2"}, {"model_dtype": "torch.float16"}, {"pp_rank": 1}])
def test_the_fingerprint_ignores_what_is_not_layout(change: dict) -> None:
    assert dataclasses.replace(NS, **change).fingerprint() == NS.fingerprint()


def test_directory_digest_follows_names_sizes_and_sampled_bytes(tmp_path) -> None:
    from kvtier.keys import directory_digest, file_digest

    (tmp_path / "a.safetensors").write_bytes(bytes(range(256)) * 8192)  # 2 MiB: sampled
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()  # subdirectories are not read
    base = directory_digest(str(tmp_path), cached=False)
    assert base == directory_digest(str(tmp_path))
    assert directory_digest(str(tmp_path), (".safetensors",)) != base
    assert file_digest(str(tmp_path / "a.safetensors")) == directory_digest(str(tmp_path), (".safetensors",))
    data = bytearray((tmp_path / "a.safetensors").read_bytes())
    data[0] ^= 1  # the first sample starts at byte 0
    (tmp_path / "a.safetensors").write_bytes(bytes(data))
    flipped = directory_digest(str(tmp_path), cached=False)
    assert flipped != base
    (tmp_path / "sub" / "x").write_text("ignored")
    assert directory_digest(str(tmp_path), cached=False) == flipped
