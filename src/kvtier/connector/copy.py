"""Block gather/scatter between vLLM's paged KV tensors and tier slots.

Runs in vLLM's worker processes. Torch ops only, so the same code runs on
CPU and CUDA. Two paths, chosen by the KV tensors' device:

* CPU: one ``copy_`` per block and layer, straight between vLLM's block and
  the slot. Measured on the 2-core test machine (bench/ttft.py, 8k-token
  prompt, 128 blocks x 4 layers): 7.7 GB/s against 1.7 GB/s for the
  vectorised path, whose advanced indexing goes through a temporary and a
  single-threaded index_put. Splitting the blocks over two threads was
  slower still (the cores are shared with vLLM's own threads).
* CUDA: vectorised: one gather on the host side (the slots), one transfer,
  one index_put on the device, since thousands of small host-to-device
  copies cost more than the extra pass.

A slot region is seen as ``(num_slots, num_layers, layer_stride)`` bytes;
layer ``i`` of a block sits at ``[i, :layer_block_bytes]``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

_MEMMOVE = os.environ.get("KVTIER_COPY", "memmove") == "memmove"

from kvtier.layout import KvLayout


def slot_matrix(rank_region: torch.Tensor, layout: KvLayout) -> torch.Tensor:
    """View ``(num_slots, rank_bytes)`` uint8 as ``(num_slots, layers, layer_stride)``."""
    n_slots = rank_region.shape[0]
    return rank_region.as_strided(
        (n_slots, len(layout.layer_names), layout.layer_stride),
        (rank_region.stride(0), layout.layer_stride, 1),
    )


def gather_blocks(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                  slots: torch.Tensor, slot_ids: Sequence[int], indexed: bool | None = None) -> None:
    """Copy blocks ``block_ids`` of every layer into ``slots[slot_ids]``.

    ``layers`` are block-major views (dimension 0 indexes blocks). On CPU
    each block is a memmove (or a ``copy_`` for non-contiguous blocks); on
    an accelerator, or with ``indexed=True``, one gather and one transfer
    per layer. Both write the same bytes.
    """
    if not block_ids:
        return
    dev = layers[0].device
    nbytes = layout.layer_block_bytes
    if indexed is None:
        indexed = dev.type != "cpu"
    if not indexed:
        if _MEMMOVE and layers[0][0].is_contiguous():
            _memmove_blocks(layers, nbytes, block_ids, slots, slot_ids, to_slots=True)
            return
        for i, bm in enumerate(layers):
            for b, s in zip(block_ids, slot_ids):
                slots[s, i, :nbytes].view(layout.dtype).view(bm.shape[1:]).copy_(bm[b])
        return
    b_idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    s_idx = torch.tensor(slot_ids, dtype=torch.long)
    for i, bm in enumerate(layers):
        src = bm.index_select(0, b_idx).reshape(len(block_ids), -1).view(torch.uint8)
        if src.device.type != "cpu":
            src = src.cpu()
        slots[s_idx, i, :nbytes] = src


def scatter_blocks(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                   slots: torch.Tensor, slot_ids: Sequence[int], indexed: bool | None = None) -> None:
    """Copy ``slots[slot_ids]`` into blocks ``block_ids`` of every layer (paths as in :func:`gather_blocks`)."""
    if not block_ids:
        return
    dev = layers[0].device
    nbytes = layout.layer_block_bytes
    if indexed is None:
        indexed = dev.type != "cpu"
    if not indexed:
        if _MEMMOVE and layers[0][0].is_contiguous():
            _memmove_blocks(layers, nbytes, block_ids, slots, slot_ids, to_slots=False)
            return
        for i, bm in enumerate(layers):
            for b, s in zip(block_ids, slot_ids):
                bm[b].copy_(slots[s, i, :nbytes].view(layout.dtype).view(bm.shape[1:]))
        return
    b_idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    s_idx = torch.tensor(slot_ids, dtype=torch.long)
    n = len(block_ids)
    for i, bm in enumerate(layers):
        raw = slots[s_idx, i, :nbytes]  # (n, nbytes) gathered copy
        src = raw.view(layout.dtype).view(n, *bm.shape[1:])
        if dev.type != "cpu":
            src = src.to(dev, non_blocking=True)
        bm[b_idx] = src


def _memmove_blocks(layers: Sequence[torch.Tensor], nbytes: int, block_ids: Sequence[int],
                    slots: torch.Tensor, slot_ids: Sequence[int], to_slots: bool) -> None:
    slot_base = slots.data_ptr()
    s_stride, l_stride = slots.stride(0), slots.stride(1)
    for i, bm in enumerate(layers):
        base, stride = bm.data_ptr(), bm.stride(0) * bm.element_size()
        for b, s in zip(block_ids, slot_ids):
            kv = base + b * stride
            slot = slot_base + s * s_stride + i * l_stride
            if to_slots:
                ctypes.memmove(slot, kv, nbytes)
            else:
                ctypes.memmove(kv, slot, nbytes)
