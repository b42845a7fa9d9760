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

A slot holds one block of every layer of one rank, layer after layer, each
layer's part padded to 64 bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

_LAYER_ALIGN = 64


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


@dataclass(frozen=True)
class KvLayout:
    """Geometry of one rank's KV: layers, the bytes of one block per layer."""

    kind: LayoutKind
    layer_names: tuple[str, ...]
    layer_block_bytes: int  # bytes of one block in one layer
    dtype: torch.dtype

    @property
    def layer_stride(self) -> int:
        return -(-self.layer_block_bytes // _LAYER_ALIGN) * _LAYER_ALIGN

    @property
    def block_bytes(self) -> int:
        """Bytes one rank's block takes in a slot (all layers)."""
        return self.layer_stride * len(self.layer_names)

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                       kind: LayoutKind | None = None) -> KvLayout:
        names = tuple(kv_caches)
        if not names:
            raise ValueError("no KV cache layers registered")
        first = kv_caches[names[0]]
        kind = kind or detect_kind(tuple(first.shape), num_blocks, first.device.type)
        per_block = block_major(first, kind)[0]
        for name in names[1:]:
            t = kv_caches[name]
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"layer {name} has shape {tuple(t.shape)} {t.dtype}, "
                                 f"unlike {names[0]}'s {tuple(first.shape)} {first.dtype}")
        return cls(kind, names, per_block.numel() * per_block.element_size(), first.dtype)


def block_major(t: torch.Tensor, kind: LayoutKind) -> torch.Tensor:
    """A view of a layer's KV tensor whose dimension 0 indexes blocks (no copy)."""
    return t if kind.block_dim == 0 else t.movedim(kind.block_dim, 0)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """K and V of one token across all layers, as vLLM stores them."""
    return 2 * num_layers * num_kv_heads * head_size * dtype_bytes
