"""Block gather/scatter between vLLM's paged KV tensors and tier slots.

Runs in vLLM's worker processes. Torch ops only, so the same code runs on
CPU and CUDA. Two paths, chosen by the KV tensors' device:

* CPU: one ``copy_`` per block and layer, straight between vLLM's block and
  the slot. Measured on the 2-core test machine (bench/ttft.py, 8k-token
  prompt, 128 blocks x 4 layers): 7.7 GB/s against 1.7 GB/s for the
  vectorised path, whose advanced indexing goes through a temporary and a
  single-threaded index_put. Splitting the blocks over two threads was
  slower still: vLLM's CPU worker binds its thread to one core, so a
  thread started from it shares that core; bound to the worker's other
  cores instead, it shares those with vLLM's OpenMP threads and the
  node's other processes, and was slower still (an 8k-token pool hit's
  load inside vLLM: 7.1-7.7 ms on two threads against 5.6-5.7 ms on one,
  docs/benchmarks.md).
* accelerator: one ``copy_(non_blocking=True)`` per block and layer,
  straight between the device block and the slot, on a stream of the
  worker's own (:class:`StreamCopies`). With the arena registered as
  page-locked memory (hostmem.pin_host_memory) each is an asynchronous DMA
  that needs no staging buffer and no host-side memcpy; an arena that could
  not be pinned gives the same bytes through the driver's bounce buffer
  (slower, and the copies block the caller). The vectorised alternative
  (``indexed=True``: gather, one transfer, index_put) went through
  pageable temporaries, so ``non_blocking`` did nothing and the save path
  waited for the forward pass; it is kept for the CPU comparison only.

A slot region is seen as ``(num_slots, num_layers, layer_stride)`` bytes;
layer ``i`` of a block sits at ``[i, :layer_block_bytes]``. The copy
functions take block-major layer views (``KvLayout.block_major``) and the
index of the first of them among the layout's layers, so one layer can be
copied at a time.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator, Sequence

import torch

_MEMMOVE = os.environ.get("KVTIER_COPY", "memmove") == "memmove"
# CUDA: kernels over the mapped arena once it is registered (see
# device_slot_view), unless KVTIER_CUDA_COPY=blocks: one DMA per block and layer, always.
KERNEL_COPIES = os.environ.get("KVTIER_CUDA_COPY", "mapped") != "blocks"
# Fewer blocks than this go by DMA even over a mapped arena: the kernels'
# host cost is per layer (~55 us a save, ~41 us a load on an H200 host),
# the DMAs' ~15 us a block plus ~23 us (saves) or ~13 us (loads) a layer:
# one block is quicker by DMA (38 and 28 us a layer), two about even, more
# by kernel (docs/benchmarks.md, "CUDA copy path").
KERNEL_MIN_BLOCKS = 2

from kvtier.layout import KvLayout, block_run


def slot_matrix(rank_region: torch.Tensor, layout: KvLayout) -> torch.Tensor:
    """View ``(num_slots, rank_bytes)`` uint8 as ``(num_slots, layers, layer_stride)``."""
    n_slots = rank_region.shape[0]
    return rank_region.as_strided(
        (n_slots, len(layout.layer_names), layout.layer_stride),
        (rank_region.stride(0), layout.layer_stride, 1),
    )


def gather_blocks(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                  slots: torch.Tensor, slot_ids: Sequence[int], indexed: bool = False,
                  first_layer: int = 0) -> None:
    """Copy blocks ``block_ids`` of ``layers`` into ``slots[slot_ids]``.

    ``layers`` are block-major views (dimension 0 indexes blocks), layers
    ``first_layer ..`` of the layout. On CPU each block is a memmove (or a
    ``copy_`` when a block is not one run of bytes); on an accelerator a
    ``copy_(non_blocking=True)`` per block on the current stream; with
    ``indexed=True`` (CPU) one gather per layer. All write the same bytes.
    """
    if not block_ids:
        return
    nbytes = layout.layer_block_bytes
    if not indexed or not layers[0][0].is_contiguous():  # the indexed path copies in view order
        if _MEMMOVE and layout.dense_blocks and layers[0].device.type == "cpu":
            _memmove_blocks(layers, nbytes, block_ids, slots, slot_ids, to_slots=True, first_layer=first_layer)
        else:
            _copy_blocks(layers, layout, block_ids, slots, slot_ids, to_slots=True, first_layer=first_layer)
        return
    dev = layers[0].device
    b_idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    s_idx = torch.tensor(slot_ids, dtype=torch.long)
    for i, bm in enumerate(layers):
        src = bm.index_select(0, b_idx).reshape(len(block_ids), -1).view(torch.uint8)
        slots[s_idx, first_layer + i, :nbytes] = src.to("cpu")


def scatter_blocks(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                   slots: torch.Tensor, slot_ids: Sequence[int], indexed: bool = False,
                   first_layer: int = 0) -> None:
    """Copy ``slots[slot_ids]`` into blocks ``block_ids`` of ``layers`` (paths as in :func:`gather_blocks`)."""
    if not block_ids:
        return
    nbytes = layout.layer_block_bytes
    if not indexed or not layers[0][0].is_contiguous():
        if _MEMMOVE and layout.dense_blocks and layers[0].device.type == "cpu":
            _memmove_blocks(layers, nbytes, block_ids, slots, slot_ids, to_slots=False, first_layer=first_layer)
        else:
            _copy_blocks(layers, layout, block_ids, slots, slot_ids, to_slots=False, first_layer=first_layer)
        return
    dev = layers[0].device
    b_idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    s_idx = torch.tensor(slot_ids, dtype=torch.long)
    n = len(block_ids)
    for i, bm in enumerate(layers):
        raw = slots[s_idx, first_layer + i, :nbytes]  # (n, nbytes) gathered copy
        bm[b_idx] = raw.view(layout.dtype).view(n, *bm.shape[1:]).to(dev)


def can_check_while_copying(layers: Sequence[torch.Tensor], layout: KvLayout) -> bool:
    """Whether :func:`scatter_checked` and :func:`gather_sealed` apply: CPU
    KV, dense blocks, memmove."""
    return bool(layers) and _MEMMOVE and layout.dense_blocks and layers[0].device.type == "cpu"


def scatter_checked(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                    slots: torch.Tensor, slot_ids: Sequence[int], check: Callable[[int], bool],
                    bad: list[int] | None = None) -> list[int]:
    """:func:`scatter_blocks` block by block, each block's layers then
    ``check(i)`` for the ``i``-th block, while the bytes the copy just read
    are still in the cache; returns the positions whose check failed (their
    copies are in vLLM's blocks, which the caller reports as load errors).

    For the checksum pass over a loaded block (:meth:`DramTier.verify`):
    run on a thread of its own after the copies, it read the slots again
    from memory and competed with the forward pass for the cores (5.2 ms
    for 127 blocks of 512 KiB beside 3.7 ms of copies, all of it on the
    TTFT); here it reads them from the cache, 0.8 ms more than the copies
    alone (docs/benchmarks.md). Only for :func:`can_check_while_copying`.
    ``bad``: the list to append the failed positions to (also the return
    value), so that what was found before an exception is not lost.
    """
    bad = [] if bad is None else bad
    for i in _block_by_block(layers, layout, block_ids, slots, slot_ids, to_slots=False):
        if not check(i):
            bad.append(i)
    return bad


def gather_sealed(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                  slots: torch.Tensor, slot_ids: Sequence[int], seal: Callable[[int], None]) -> None:
    """:func:`gather_blocks` block by block, each block's layers then
    ``seal(i)`` for the ``i``-th block, which checksums it while the bytes
    just copied are still in the cache (:func:`written_runs`): gathering
    every block first and checksumming after read them all again from
    memory (an 8k-token save of 127 blocks of 512 KiB: 4.8-5.3 ms against
    6.2-6.9 ms, bench/blockcopy.py).
    Only for :func:`can_check_while_copying`. An exception ends the call:
    the blocks sealed before it are whole, the others may not be.
    """
    for i in _block_by_block(layers, layout, block_ids, slots, slot_ids, to_slots=True):
        seal(i)


def written_runs(layers: Sequence[torch.Tensor], layout: KvLayout,
                 rank_bytes: int) -> Callable[[int, int], list[ctypes.Array]]:
    """``runs(block_id, part)``: the bytes a save of block ``block_id`` means
    a slot's part for this rank (``rank_bytes`` long, at address ``part``)
    to hold, in their order there: each layer's block read from vLLM's KV
    (block-major ``layers``, dense blocks on CPU), and the part's own bytes
    between and after them (alignment, which no save writes). Addresses
    are worked out once, here, for a save's blocks: per block, the runs
    cost a few ctypes views.

    A seal checksums these rather than the slot: a late writer (a worker of
    an ended session whose slot was given to another block meanwhile) whose
    copy lands between this block's copy and its seal then leaves a slot
    that fails its check, where a checksum read from the slot would have
    sealed the late writer's bytes under this block's key. The views are
    valid while the tensors and the arena are; for immediate use.
    """
    nbytes, stride = layout.layer_block_bytes, layout.layer_stride
    block = ctypes.c_ubyte * nbytes
    bases = [(bm.data_ptr(), bm.stride(0) * bm.element_size()) for bm in layers]
    gaps = []  # after layer j: (offset in the part, its ctypes type), or None
    for j in range(len(layers)):
        start = j * stride + nbytes
        gap = (stride * (j + 1) if j + 1 < len(layers) else rank_bytes) - start
        gaps.append((start, ctypes.c_ubyte * gap) if gap > 0 else None)

    def runs(block_id: int, part: int) -> list[ctypes.Array]:
        out = []
        for (base, step), gap in zip(bases, gaps):
            out.append(block.from_address(base + block_id * step))
            if gap is not None:
                out.append(gap[1].from_address(part + gap[0]))
        return out

    return runs


def _block_by_block(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                    slots: torch.Tensor, slot_ids: Sequence[int], to_slots: bool) -> Iterator[int]:
    """Copy block ``i`` in every layer (one memmove each, towards the slots
    or from them), then yield ``i``: the caller checks or seals it while
    its bytes are in the cache, before the next block is copied."""
    nbytes = layout.layer_block_bytes
    slot_base = slots.data_ptr()
    s_stride, l_stride = slots.stride(0), slots.stride(1)
    bases = [(bm.data_ptr(), bm.stride(0) * bm.element_size()) for bm in layers]
    memmove = ctypes.memmove
    for i, (b, s) in enumerate(zip(block_ids, slot_ids)):
        slot = slot_base + s * s_stride
        for j, (base, stride) in enumerate(bases):
            if to_slots:
                memmove(slot + j * l_stride, base + b * stride, nbytes)
            else:
                memmove(base + b * stride, slot + j * l_stride, nbytes)
        yield i


def _copy_blocks(layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
                 slots: torch.Tensor, slot_ids: Sequence[int], to_slots: bool, first_layer: int) -> None:
    """One ``copy_`` per block and layer; asynchronous between a device and pinned slots.

    A dense block is copied as its run of memory (the bytes memmove would
    copy, and one DMA with no temporary); another in its view's order.
    """
    nbytes = layout.layer_block_bytes
    # Asynchronous only where StreamCopies waits for the copies (CUDA): on
    # another accelerator a non-blocking copy could still run when the slot
    # is sealed.
    non_blocking = layers[0].device.type == "cuda"
    for i, bm in enumerate(layers):
        shape = (-1,) if layout.dense_blocks else bm.shape[1:]
        for b, s in zip(block_ids, slot_ids):
            slot = slots[s, first_layer + i, :nbytes].view(layout.dtype).view(shape)
            block = block_run(bm, b) if layout.dense_blocks else bm[b]
            if to_slots:
                slot.copy_(block, non_blocking=non_blocking)
            else:
                block.copy_(slot, non_blocking=non_blocking)


def _memmove_blocks(layers: Sequence[torch.Tensor], nbytes: int, block_ids: Sequence[int],
                    slots: torch.Tensor, slot_ids: Sequence[int], to_slots: bool, first_layer: int) -> None:
    slot_base = slots.data_ptr()
    s_stride, l_stride = slots.stride(0), slots.stride(1)
    for i, bm in enumerate(layers):
        base, stride = bm.data_ptr(), bm.stride(0) * bm.element_size()
        for b, s in zip(block_ids, slot_ids):
            kv = base + b * stride
            slot = slot_base + s * s_stride + (first_layer + i) * l_stride
            if to_slots:
                ctypes.memmove(slot, kv, nbytes)
            else:
                ctypes.memmove(kv, slot, nbytes)


class StreamCopies:
    """Block copies between a CUDA device's KV and the arena, on a stream of their own.

    Runs in a worker process, on vLLM's thread. Per engine step:

    1. :meth:`begin_step` (before the forward pass): vLLM's stream waits
       for this stream's earlier work, so no kernel of the new step writes
       a block that a save of an earlier step is still reading (vLLM may
       have freed and reallocated it: preemption frees without asking);
    2. :meth:`load` queues every layer's host-to-device copies, records
       one event per layer and returns one recorded after them all (the
       checksum pass waits for it); :meth:`wait_layer` (vLLM's
       ``wait_for_layer_load``) makes vLLM's stream wait for that layer's
       event only, so the first layers compute while later ones load;
    3. :meth:`save_layer` (vLLM's ``save_kv_layer``, right after a layer's
       attention wrote its KV) queues that layer's device-to-host copies
       behind the work vLLM has queued so far;
    4. :meth:`end_saves` records an event; the caller seals the slots once
       ``event.query()`` is true, without blocking vLLM's thread.

    Nothing here synchronises the host with the device except
    :meth:`close`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._layer_ready: dict[int, torch.cuda.Event] = {}
        # The slot matrix as a device tensor (device_slot_view) once the
        # arena is page-locked and mapped, and the host matrix it stands
        # for: copies of those slots are then one kernel a layer.
        self._mapped: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ids: tuple | None = None  # (block ids, slot ids, blocks, slots, the two device tensors)

    def map_slots(self, slots: torch.Tensor | None, mapped: torch.Tensor | None = None) -> None:
        """Copy ``slots`` through ``mapped`` (its device view) from now on;
        ``(None)``: per block again (before the registration ends)."""
        self._mapped = None if slots is None or mapped is None else (slots, mapped)

    @property
    def mapped(self) -> bool:
        return self._mapped is not None

    def _view(self, slots: torch.Tensor, n: int) -> torch.Tensor | None:
        """The device view to copy ``n`` blocks of ``slots`` through, or None (one DMA per block)."""
        m = self._mapped
        if n < KERNEL_MIN_BLOCKS or m is None or m[0].data_ptr() != slots.data_ptr() or m[0].shape != slots.shape:
            return None
        return m[1]

    def _indices(self, block_ids: Sequence[int], slot_ids: Sequence[int], num_blocks: int,
                 num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids as device tensors, copied on this stream (current when
        called) from page-locked memory; the last pair is reused (a step's
        layers name the same blocks)."""
        last = self._ids
        if last is not None and last[:4] == (block_ids, slot_ids, num_blocks, num_slots):
            return last[4], last[5]
        checked_ids(block_ids, num_blocks, "block")
        checked_ids(slot_ids, num_slots, "slot")
        host = torch.tensor([list(block_ids), list(slot_ids)], dtype=torch.long).pin_memory()
        both = host.to(self.device, non_blocking=True)
        self._ids = (list(block_ids), list(slot_ids), num_blocks, num_slots, both[0], both[1])
        return both[0], both[1]

    def begin_step(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def load(self, layers: Sequence[torch.Tensor], layout: KvLayout, block_ids: Sequence[int],
             slots: torch.Tensor, slot_ids: Sequence[int]) -> torch.cuda.Event:
        """Queue the loads; returns an event that completes once every copy
        has read its slot (the slots' checksums are verified after it: a
        slot rewritten before the DMA read it must not pass)."""
        # The blocks were allocated for this step; work vLLM queued before
        # (earlier steps) may still use them.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        view = self._view(slots, len(block_ids))
        with torch.cuda.stream(self.stream):
            if view is not None:
                b_idx, s_idx = self._indices(block_ids, slot_ids, layers[0].shape[0], view.shape[0])
            for i, bm in enumerate(layers):
                if view is not None:
                    indexed_scatter(bm, layout, b_idx, view, s_idx, i)
                else:
                    scatter_blocks([bm], layout, block_ids, slots, slot_ids, first_layer=i)
                ready = torch.cuda.Event()
                ready.record(self.stream)
                self._layer_ready[i] = ready
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait_layer(self, index: int) -> None:
        """vLLM's stream waits for layer ``index``'s loads (no host wait)."""
        ready = self._layer_ready.pop(index, None)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def wait_loads(self) -> None:
        """vLLM's stream waits for every load not waited for layer by layer."""
        for index in list(self._layer_ready):
            self.wait_layer(index)

    def save_layer(self, index: int, bm: torch.Tensor, layout: KvLayout, block_ids: Sequence[int],
                   slots: torch.Tensor, slot_ids: Sequence[int]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        view = self._view(slots, len(block_ids))
        with torch.cuda.stream(self.stream):
            if view is not None:
                b_idx, s_idx = self._indices(block_ids, slot_ids, bm.shape[0], view.shape[0])
                indexed_gather(bm, layout, b_idx, view, s_idx, index)
            else:
                gather_blocks([bm], layout, block_ids, slots, slot_ids, first_layer=index)

    def end_saves(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def close(self) -> None:
        self.stream.synchronize()


# --- device kernels over the mapped arena (CUDA) ----------------------------------
#
# One copy_ per block and layer costs the host ~15 us of Python and a DMA
# launch each (an H200 host): a 64k-token save of an 8B-class model is
# 4,096 blocks x 32 layers, ~2 s of vLLM's thread, at 3-5 GB/s. With the
# arena page-locked and mapped into the device's address space at its own
# addresses (hostmem.mapped_at_host_address), the slots are also a CUDA
# tensor, and one index_copy_ per layer moves a step's blocks of that
# layer: the kernel reads or writes host memory over the bus, the host
# launches two kernels a layer (per 64 MiB of blocks) whatever the number
# of blocks. The bytes written are the same as the per-block path's
# (tests/unit/test_layout_copy.py).


class _CudaArrayInterface:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def device_slot_view(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``slots`` (a host tensor over page-locked memory mapped into
    ``device``'s address space at the same addresses) as a tensor of
    ``device`` with the same shape and strides: kernels read and write the
    host memory through it. Valid while the registration is."""
    span = 1 + sum((n - 1) * s for n, s in zip(slots.shape, slots.stride()) if n > 0)
    flat = torch.as_tensor(_CudaArrayInterface(slots.data_ptr(), span), device=device)
    want = torch.device(device)
    if want.index is None:
        want = torch.device(want.type, torch.cuda.current_device())
    if flat.data_ptr() != slots.data_ptr() or flat.device != want:
        # A copy (the driver placed the memory on another device): saves
        # would land in it and never in the arena.
        raise RuntimeError(f"the arena's view on {device} is not the arena (at {flat.data_ptr():#x} on "
                           f"{flat.device}, the arena at {slots.data_ptr():#x})")
    return flat.as_strided(slots.shape, slots.stride(), 0)


def _words(*rows: torch.Tensor) -> list[torch.Tensor]:
    """2-D uint8 views whose rows are runs of bytes, as the widest integer
    type that every view's address, row stride and row length allow (fewer,
    wider accesses for the copy kernels)."""
    for width, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(r.data_ptr() % width == 0 and r.stride(0) % width == 0 and r.shape[1] % width == 0
               for r in rows):
            return [r.view(dtype) for r in rows]
    return list(rows)


def _block_rows(bm: torch.Tensor) -> torch.Tensor:
    """A block-major view of dense blocks as ``(blocks, bytes of a block)``
    uint8 rows, each block's run of memory (what :func:`block_run` gives)."""
    rows = bm.as_strided((bm.shape[0], bm[0].numel()), (bm.stride(0), 1), bm.storage_offset())
    return rows.view(torch.uint8)


def checked_ids(ids: Sequence[int], limit: int, what: str) -> None:
    """Raise ValueError unless every id is in ``[0, limit)``: an index out of
    range in a device kernel is a device-side assert that ends the CUDA
    context (and vLLM with it), so it is refused on the host first."""
    if ids and (min(ids) < 0 or max(ids) >= limit):
        bad = next(i for i in ids if not 0 <= i < limit)
        raise ValueError(f"{what} {bad} is outside [0, {limit})")


# Device memory the kernel path's temporaries may take at once (a gather's
# result before its index_copy_): it is outside what vLLM budgeted for its
# own tensors, and the caching allocator keeps it once used. A 64k-token load
# of an 8B-class model is 256 MiB a layer: four chunks.
CHUNK_BYTES = 64 << 20


def _chunks(n: int, row_bytes: int, max_bytes: int) -> Iterator[slice]:
    per = max(1, max_bytes // max(1, row_bytes))
    for start in range(0, n, per):
        yield slice(start, min(n, start + per))


def indexed_gather(bm: torch.Tensor, layout: KvLayout, block_idx: torch.Tensor, dslots: torch.Tensor,
                   slot_idx: torch.Tensor, layer: int, max_bytes: int = CHUNK_BYTES) -> None:
    """Copy blocks ``block_idx`` of one layer (block-major view ``bm``) into
    rows ``slot_idx`` of ``dslots`` (the slot matrix, on any device), layer
    ``layer``: a gather and an index_copy_ per ``max_bytes`` of blocks, the
    bytes :func:`gather_blocks` writes. The indices are tensors of ``bm``'s
    device, checked by the caller."""
    nbytes = layout.layer_block_bytes
    for part in _chunks(len(block_idx), nbytes, max_bytes):
        b_idx, s_idx = block_idx[part], slot_idx[part]
        if layout.dense_blocks:
            dst, rows = _words(dslots[:, layer, :nbytes], _block_rows(bm))
            src = rows.index_select(0, b_idx)
        else:  # the block in its view's order, as copy_ of the block writes it
            src = bm.index_select(0, b_idx).reshape(len(b_idx), -1).view(torch.uint8)
            dst, src = _words(dslots[:, layer, :nbytes], src)
        dst.index_copy_(0, s_idx, src)


def indexed_scatter(bm: torch.Tensor, layout: KvLayout, block_idx: torch.Tensor, dslots: torch.Tensor,
                    slot_idx: torch.Tensor, layer: int, max_bytes: int = CHUNK_BYTES) -> None:
    """The reverse of :func:`indexed_gather`: rows ``slot_idx`` into blocks ``block_idx``."""
    nbytes = layout.layer_block_bytes
    for part in _chunks(len(block_idx), nbytes, max_bytes):
        b_idx, s_idx = block_idx[part], slot_idx[part]
        if layout.dense_blocks:
            src, rows = _words(dslots[:, layer, :nbytes], _block_rows(bm))
            rows.index_copy_(0, b_idx, src.index_select(0, s_idx))
        else:
            src = _words(dslots[:, layer, :nbytes])[0].index_select(0, s_idx)
            blocks = src.view(torch.uint8).view(layout.dtype).view(len(b_idx), *bm.shape[1:])
            bm.index_copy_(0, b_idx, blocks)
