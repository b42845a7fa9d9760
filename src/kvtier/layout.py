"""KV layout of a model: how one block's bytes sit in vLLM's paged tensors.

Runs in vLLM's worker processes (to gather and scatter blocks) and wherever a
slot size is needed. A :class:`KvLayout` is described once per attention
backend by :class:`LayoutKind`: which dimension of a layer's KV tensor
indexes blocks. Everything else (heads, tokens, K/V split) is copied as
opaque bytes, so a layout is bit-exact as long as the same kind reads what
it wrote; the kind's name is part of every key's namespace, so a CPU block
is never loaded into a CUDA flash-attention tensor or the reverse.

Known kinds:

* ``cpu``: vLLM CPU attention, per layer ``(num_blocks, kv_heads,
  block_tokens, 2 * head_size)``; block dimension 0.
* ``flash``: CUDA flash-attention, per layer ``(2, num_blocks, block_tokens,
  kv_heads, head_size)``; block dimension 1.
* ``blocks_first``: any per-layer tensor whose dimension 0 indexes blocks
  (FlashInfer's ``(num_blocks, 2, ...)`` among them).

vLLM may split each of its blocks into smaller kernel blocks when the
attention backend takes fewer tokens per block than the KV cache manager
uses (``prepare_kernel_block_sizes`` in vLLM's GPU runner): a layer's
tensor then has ``num_blocks * k`` rows, the ``k`` kernel blocks of manager
block ``b`` being rows ``b*k .. b*k+k-1`` (vLLM's ``group_kernel_blocks``).
:func:`detect_kind` reads ``k`` from the shape and checks it against the
tokens per block; :func:`block_major` groups the rows back into manager
blocks, so a slot still holds one manager block. A shape that fits no known
reading raises :class:`ValueError`; the worker then stays inert (every load
a miss, nothing saved) rather than stopping the engine.

A slot holds one block of every layer of one rank, layer after layer, each
layer's part padded to 64 bytes. A slot holds a block's bytes as they sit
in memory when every layer's block is one dense run of bytes
(:attr:`KvLayout.dense_blocks`; in whatever order of heads and tokens the
kernel layout chose), so the bytes do not depend on how vLLM views them
(split into kernel blocks or not); otherwise in the logical order of the
view.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

LAYER_ALIGN = 64  # each layer's page of a block starts at a multiple of this in a slot


class LayoutKind(enum.Enum):
    CPU = "cpu"
    FLASH = "flash"
    BLOCKS_FIRST = "blocks_first"

    @property
    def block_dim(self) -> int:
        return 1 if self is LayoutKind.FLASH else 0


def detect_kind(shape: tuple[int, ...], num_blocks: int, device_type: str) -> LayoutKind:
    """Name the layout of one layer's KV tensor from its shape.

    ``num_blocks`` is vLLM's block count from its KV cache config. A shape in
    which both readings are possible is refused rather than guessed.
    """
    first = shape[0] == num_blocks
    second = len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks
    if first and second:
        raise ValueError(f"KV tensor shape {shape} is ambiguous with {num_blocks} blocks; set kv_layout")
    if second:
        return LayoutKind.FLASH
    if first:
        return LayoutKind.CPU if device_type == "cpu" else LayoutKind.BLOCKS_FIRST
    raise ValueError(f"KV tensor shape {shape} has no dimension of {num_blocks} blocks")


# vLLM's per-layer view is logically (blocks, heads, tokens, content) in
# every physical layout (vllm/v1/kv_cache_interface.py, create_kv_cache_views).
_TOKEN_DIM = 2


def kernel_split(shape: tuple[int, ...], num_blocks: int, block_tokens: int | None) -> int:
    """How many kernel blocks make one of vLLM's blocks in a tensor of ``shape``: 1 if unsplit.

    A split is read only where it is unambiguous: a 4-dimensional
    (blocks, heads, tokens, content) view whose first dimension is a
    multiple ``k`` of ``num_blocks`` and whose token dimension holds
    ``block_tokens / k`` tokens. Raises ValueError otherwise.
    """
    if shape and shape[0] == num_blocks:
        return 1
    if (block_tokens and num_blocks > 0 and len(shape) == 4 and shape[0] > num_blocks
            and shape[0] % num_blocks == 0):
        k = shape[0] // num_blocks
        if shape[_TOKEN_DIM] * k == block_tokens:
            return k
    raise ValueError(f"KV tensor shape {shape} is neither {num_blocks} blocks of {block_tokens} tokens "
                     f"nor a whole split of them into kernel blocks")


@dataclass(frozen=True)
class KvLayout:
    """Geometry of one rank's KV: layers, the bytes of one block per layer."""

    kind: LayoutKind
    layer_names: tuple[str, ...]
    layer_block_bytes: int  # bytes of one block in one layer
    dtype: torch.dtype
    kernel_blocks: int = 1  # vLLM's kernel blocks per block (1: not split)
    dense_blocks: bool = True  # every layer's block is one dense run of bytes (any dimension order)

    @property
    def layer_stride(self) -> int:
        return -(-self.layer_block_bytes // LAYER_ALIGN) * LAYER_ALIGN

    @property
    def block_bytes(self) -> int:
        """Bytes one rank's block takes in a slot (all layers)."""
        return self.layer_stride * len(self.layer_names)

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                       kind: LayoutKind | None = None, block_tokens: int | None = None) -> KvLayout:
        """The layout of ``kv_caches`` (layer name -> tensor, as vLLM registers them).

        ``block_tokens`` (vLLM's tokens per block) lets a kernel-block split
        be recognised. Raises ValueError for tensors that are not all the
        same shape, dtype and strides, or whose blocks cannot be found.
        """
        names = tuple(kv_caches)
        if not names:
            raise ValueError("no KV cache layers registered")
        first = kv_caches[names[0]]
        split = 1
        shape = tuple(first.shape)
        if kind is None:
            if shape[0] != num_blocks and not (len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks):
                # No dimension of num_blocks: blocks split into kernel
                # blocks, or a shape kvtier cannot read (kernel_split raises).
                kernel_split(shape, num_blocks, block_tokens)
                kind = LayoutKind.CPU if first.device.type == "cpu" else LayoutKind.BLOCKS_FIRST
            else:
                kind = detect_kind(shape, num_blocks, first.device.type)
        if kind.block_dim == 0:
            split = kernel_split(shape, num_blocks, block_tokens)
        dense = True
        for name in names:
            t = kv_caches[name]
            # Strides too: slot bytes are copied as each layer's own block
            # bytes, so a layer laid out unlike the first would be misread.
            if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
                raise ValueError(f"layer {name} has shape {tuple(t.shape)} {t.dtype} strides {t.stride()}, "
                                 f"unlike {names[0]}'s {tuple(first.shape)} {first.dtype} {first.stride()}")
            dense &= is_dense(_grouped(t, kind, split)[0])
        per_block = _grouped(first, kind, split)[0]
        return cls(kind, names, per_block.numel() * per_block.element_size(), first.dtype, split, dense)

    def block_major(self, t: torch.Tensor) -> torch.Tensor:
        """A view of one layer's tensor whose dimension 0 indexes vLLM's blocks
        (kernel blocks grouped back into their block; no copy)."""
        return _grouped(t, self.kind, self.kernel_blocks)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one run of memory with no gap or overlap, in any dimension order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def block_run(bm: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block`` of a block-major view as its run of memory, 1-D in
    memory order (a view; the block must be dense, see :func:`is_dense`)."""
    return bm.as_strided((bm[0].numel(),), (1,), bm.storage_offset() + block * bm.stride(0))


def _grouped(t: torch.Tensor, kind: LayoutKind, split: int) -> torch.Tensor:
    bm = block_major(t, kind)
    return bm if split == 1 else bm.unflatten(0, (bm.shape[0] // split, split))


def block_major(t: torch.Tensor, kind: LayoutKind) -> torch.Tensor:
    """A view of a layer's KV tensor whose dimension 0 indexes blocks (no copy)."""
    return t if kind.block_dim == 0 else t.movedim(kind.block_dim, 0)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """K and V of one token across all layers, as vLLM stores them."""
    return 2 * num_layers * num_kv_heads * head_size * dtype_bytes
