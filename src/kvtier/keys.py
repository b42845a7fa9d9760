"""BlockKey: a stable name for the KV of one full block of tokens.

Runs wherever keys are needed (vLLM's scheduler process, tools, tests). A key
is a 128-bit chained digest (``h`` = the first 16 bytes of SHA-256)::

    seed    = h(b"kvtier-ns-v3\\0" + canonical namespace bytes)
    key[0]  = h(seed + tokens[0:B] as int32 little-endian)
    key[i]  = h(key[i-1] + tokens[i*B:(i+1)*B] as int32 little-endian)

so a key names the whole prefix up to and including its block, never the
block's tokens alone. The namespace holds everything that changes the bytes
of a block (model identity, the dtype the model computes in, vLLM's KV cache
dtype string, the stored dtype, KV layout, block size, parallel layout), so
two models or layouts never share a key. Nothing here depends on the
process: no Python ``hash``, no PYTHONHASHSEED, no pointer values. The
golden vectors in tests/unit/test_keys.py pin the encoding; changing it
changes every key in every pool, so it is versioned by the ``v3`` tag (v1
lacked ``cache_dtype`` and ``model_dtype``: every fp8 variant stored as
uint8 shared one namespace; v2 chained xxh3-128).

Why SHA-256 and not xxh3: token ids come from users, and a pool is shared
by every tenant of a node (of a cluster, with the cluster tier). xxh3 is
not made to resist crafted collisions: a tenant who found token blocks
whose chained key equals another tenant's prefix (or a cache salt whose
seed equals another's) could save KV under that key and have the other
load it. vLLM's own prefix cache uses SHA-256 by default for the same
reason. Truncated to 128 bits, a collision takes about 2^64 work. Hashing
costs the same here: converting the token list dominates (a 64k-token
request's keys in 1.7 ms against 2.1 ms with xxh3, measured on the 2-core
test machine).

:meth:`KeyNamespace.fingerprint` digests the layout part alone (what decides
how a slot's bytes are arranged, not which model made them); an SSD tier
keeps it in its superblock and starts empty when it changes.
:func:`directory_digest` names the contents of a model or adapter directory
for the namespace and for per-request seeds.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

KEY_BYTES = 16


def digest16(data: bytes) -> bytes:
    """The first 16 bytes of SHA-256: keys and seeds (see the module's note on why not xxh3)."""
    return hashlib.sha256(data).digest()[:KEY_BYTES]


@dataclass(frozen=True)
class KeyNamespace:
    """What must differ for two blocks of the same tokens to hold different bytes.

    ``model`` names the weights and what changes their numerics (path or
    repository at a commit, digests of the config and weights, or
    ``model_id``; quantization, HF overrides). ``dtype`` is the torch dtype
    the KV is stored in, ``cache_dtype`` vLLM's KV cache dtype string: every
    fp8 and fp4 format is stored as ``torch.uint8``, so the string is what
    tells e4m3 from e5m2, per-tensor from per-token-head scales, or nvfp4.
    ``model_dtype`` is the dtype K and V are computed in (before an fp8 cast,
    bf16 and fp16 give other bytes). ``layout`` describes one rank's block in
    memory (device, attention backend, kernel layout, spec type, layers, the
    per-layer block shape, page bytes).
    """

    model: str
    dtype: str
    layout: str
    block_tokens: int
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    cache_dtype: str = "auto"
    model_dtype: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def seed(self) -> bytes:
        return digest16(b"kvtier-ns-v3\0" + self.encode())

    def fingerprint(self) -> bytes:
        """16 bytes naming how a slot's bytes are arranged, whatever model made them.

        Covers the stored dtype, vLLM's cache dtype string, the layout, the
        block size and the parallel layout (which decides how many rank
        parts a slot holds); not the model identity, so a new checkpoint
        keeps the tier's geometry (its old blocks simply never match).
        """
        fields = {"dtype": self.dtype, "cache_dtype": self.cache_dtype, "layout": self.layout,
                  "block_tokens": self.block_tokens, "tp_size": self.tp_size, "pp_size": self.pp_size}
        return xxhash.xxh3_128_digest(b"kvtier-layout-v1\0"
                                      + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


def _file_signature(directory: str, suffixes: tuple[str, ...] | None,
                    names: tuple[str, ...] | None = None) -> tuple[tuple[str, int, int, int], ...]:
    out = []
    for name in sorted(os.listdir(directory) if names is None else names):
        if suffixes is not None and not name.endswith(suffixes):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)  # follows links: a Hugging Face snapshot links to its blobs
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _digest_files(directory: str, signature: tuple[tuple[str, int, int, int], ...], samples: int,
                  chunk: int) -> str:
    h = xxhash.xxh3_128()
    for name, size, _, _ in signature:
        h.update(f"{name}:{size};".encode())
        with open(os.path.join(directory, name), "rb") as f:
            if size <= samples * chunk:
                h.update(f.read())
                continue
            for i in range(samples):
                f.seek(size * i // samples)
                h.update(f.read(chunk))
    return h.hexdigest()


def directory_digest(directory: str, suffixes: tuple[str, ...] | None = None, samples: int = 16,
                     chunk: int = 1 << 16, cached: bool = True) -> str:
    """Digest of the regular files in ``directory`` (not its subdirectories):
    names, sizes, and ``samples`` chunks of ``chunk`` bytes spread over each
    file (small files whole). ``suffixes`` limits it to names ending so.

    A fine-tune usually keeps config.json unchanged, so names and sizes
    alone would let a new checkpoint under the same path hit the old one's
    blocks; sampling costs a few MiB of reads. Results are cached by each
    file's name, size, mtime and inode, so asking again for an unchanged
    directory (a LoRA adapter on every request) only stats its files; a file
    rewritten in place within one tick of the file system's clock keeps its
    signature, so a caller that asks once per process passes ``cached=False``.
    """
    signature = _file_signature(directory, suffixes)
    if not cached:
        return _digest_files.__wrapped__(directory, signature, samples, chunk)
    return _digest_files(directory, signature, samples, chunk)


def file_digest(path: str, samples: int = 16, chunk: int = 1 << 16) -> str:
    """:func:`directory_digest` of the single file ``path`` (a GGUF model, say)."""
    directory, name = os.path.split(os.path.abspath(path))
    return _digest_files(directory, _file_signature(directory, None, (name,)), samples, chunk)


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
    sha = hashlib.sha256
    for off in range(0, len(raw), step):
        prev = sha(prev + raw[off : off + step]).digest()[:KEY_BYTES]
        out.append(prev)
    return out


KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")  # a key as raw bytes: tolist() gives every key whole, trailing zeros too


class PackedKeys(Sequence[bytes]):
    """Block keys as one buffer of 16-byte keys back to back, as the meta
    service receives them: a probe reads them as an array (:meth:`array`)
    and a bytes object per key is made only when one is asked for (the
    list, made once, costs ~0.2 ms for 4,096 keys on the test machine)."""

    __slots__ = ("blob", "_list")

    def __init__(self, blob: bytes) -> None:
        if len(blob) % KEY_BYTES:
            raise ValueError(f"{len(blob)} bytes is not a whole number of {KEY_BYTES}-byte keys")
        self.blob = blob
        self._list: list[bytes] | None = None

    def __len__(self) -> int:
        return len(self.blob) // KEY_BYTES

    def array(self) -> np.ndarray:
        """The keys as an (n, 2) array of their little-endian uint64 halves (a view, no copy)."""
        return np.frombuffer(self.blob, dtype="<u8").reshape(-1, 2)

    def as_list(self) -> list[bytes]:
        if self._list is None:
            self._list = np.frombuffer(self.blob, dtype=KEY_DTYPE).tolist()
        return self._list

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - int or slice, as a list's
        if isinstance(i, slice) and self._list is None and i.step in (None, 1):
            start, stop, _ = i.indices(len(self))
            return PackedKeys(self.blob[start * KEY_BYTES : max(start, stop) * KEY_BYTES])
        return self.as_list()[i]

    def __iter__(self):  # noqa: ANN204
        return iter(self.as_list())

    def iter_from(self, start: int) -> Iterator[bytes]:
        """The keys from ``start`` on, each made when reached (a probe's walk
        past its run in the ready index usually stops after a key or two)."""
        if self._list is not None:
            return itertools.islice(self._list, start, None)
        blob = self.blob
        return (blob[i : i + KEY_BYTES] for i in range(start * KEY_BYTES, len(blob), KEY_BYTES))


class KeyRun(list):
    """Block keys as a list, with the same keys as one buffer (``packed``)
    when their owner keeps one. The connector keeps each request's keys
    both ways as they are made: a placement that sends keys (the meta
    service's client) sends the buffer instead of joining 4,096 keys again
    at every lookup (~0.1 ms), and one that looks them up in process reads
    the list, whose keys have their hashes cached. A buffer whose length
    does not fit the list is not used (:func:`kvtier.pool.wire.pack_keys`)."""

    __slots__ = ("packed",)

    def __init__(self, keys: Iterable[bytes] = (), packed: bytes | None = None) -> None:
        super().__init__(keys)
        self.packed = packed
