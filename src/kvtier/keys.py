"""BlockKey: a stable name for the KV of one full block of tokens.

Runs wherever keys are needed (vLLM's scheduler process, tools, tests). A key
is a 128-bit chained digest::

    seed    = xxh3_128(b"kvtier-ns-v1\\0" + canonical namespace bytes)
    key[0]  = xxh3_128(seed + tokens[0:B] as int32 little-endian)
    key[i]  = xxh3_128(key[i-1] + tokens[i*B:(i+1)*B] as int32 little-endian)

so a key names the whole prefix up to and including its block, never the
block's tokens alone. The namespace holds everything that changes the bytes
of a block (model identity, dtype, KV layout, block size, parallel layout),
so two models or layouts never share a key. Nothing here depends on the
process: no Python ``hash``, no PYTHONHASHSEED, no pointer values. The
golden vectors in tests/unit/test_keys.py pin the encoding; changing it
changes every key in every pool, so it is versioned by the ``v1`` tag.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

KEY_BYTES = 16


@dataclass(frozen=True)
class KeyNamespace:
    """What must differ for two blocks of the same tokens to hold different bytes."""

    model: str
    dtype: str
    layout: str
    block_tokens: int
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def seed(self) -> bytes:
        return xxhash.xxh3_128_digest(b"kvtier-ns-v1\0" + self.encode())


BlockKey = bytes  # KEY_BYTES long


def block_keys(seed: bytes, token_ids: Sequence[int] | np.ndarray, block_tokens: int, start: int = 0,
               parent: bytes | None = None) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` is the key of block ``start - 1`` (``None`` when ``start`` is 0),
    which lets callers extend a request's keys as its tokens grow without
    hashing the prefix again. A trailing partial block gets no key.
    """
    n_full = len(token_ids) // block_tokens
    if start >= n_full:
        return []
    if (parent is None) != (start == 0):
        raise ValueError("parent must be given exactly when start > 0")
    arr = np.asarray(token_ids[start * block_tokens : n_full * block_tokens], dtype="<i4")
    raw = arr.tobytes()
    step = block_tokens * 4
    prev = seed if parent is None else parent
    out: list[BlockKey] = []
    digest = xxhash.xxh3_128_digest
    for off in range(0, len(raw), step):
        prev = digest(prev + raw[off : off + step])
        out.append(prev)
    return out
