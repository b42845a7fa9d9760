"""kvtier.layout and kvtier.connector.copy: layouts, and blocks through a real arena.

The round trip builds random KV tensors in each layout, gathers blocks into
a slot matrix over one rank's region of a DramTier (as the worker does),
zeroes them, scatters them back and compares bits.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.connector.copy import can_check_while_copying, gather_blocks, gather_sealed, scatter_blocks
from kvtier.connector.copy import scatter_checked, slot_matrix, written_runs
from kvtier.layout import KvLayout, LayoutKind, block_major, block_run, detect_kind, kv_bytes_per_token
from kvtier.tier import DramTier
from kvtier.tier.dram import checksum, checksum_runs

NUM_BLOCKS = 8
BLOCK_TOKENS = 4
HEADS = 3
HEAD_SIZE = 5  # 120 elements a block: layer parts need padding to 64 bytes


def shape_of(kind: LayoutKind, num_blocks: int = NUM_BLOCKS) -> tuple[int, ...]:
    if kind is LayoutKind.FLASH:
        return (2, num_blocks, BLOCK_TOKENS, HEADS, HEAD_SIZE)
    return (num_blocks, HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE)


def random_kv(kind: LayoutKind, dtype: torch.dtype, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Random bit patterns (NaNs and infinities included) so only a bit-exact copy passes."""
    g = torch.Generator().manual_seed(seed)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    info = torch.iinfo(bits)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randint(info.min, info.max, shape_of(kind), dtype=bits,
                                                          generator=g).view(dtype)
        for i in range(layers)
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- detect_kind ------------------------------------------------------------


def test_detect_cpu_shape() -> None:
    shape = shape_of(LayoutKind.CPU)
    assert detect_kind(shape, NUM_BLOCKS, "cpu") is LayoutKind.CPU
    assert detect_kind(shape, NUM_BLOCKS, "cuda") is LayoutKind.BLOCKS_FIRST


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_detect_flash_shape(device_type: str) -> None:
    assert detect_kind(shape_of(LayoutKind.FLASH), NUM_BLOCKS, device_type) is LayoutKind.FLASH


def test_detect_flashinfer_blocks_first() -> None:
    shape = (NUM_BLOCKS, 2, BLOCK_TOKENS, HEADS, HEAD_SIZE)
    assert detect_kind(shape, NUM_BLOCKS, "cuda") is LayoutKind.BLOCKS_FIRST


def test_ambiguous_shape_refused() -> None:
    # Two blocks: (2, 2, ...) reads as blocks-first and as flash.
    with pytest.raises(ValueError, match="ambiguous"):
        detect_kind((2, 2, BLOCK_TOKENS, HEADS, HEAD_SIZE), 2, "cpu")


def test_shape_without_block_dimension_refused() -> None:
    with pytest.raises(ValueError):
        detect_kind((3, 7, BLOCK_TOKENS, HEADS, HEAD_SIZE), NUM_BLOCKS, "cpu")
    with pytest.raises(ValueError):
        detect_kind((NUM_BLOCKS + 1,), NUM_BLOCKS, "cpu")


def test_block_dims() -> None:
    assert LayoutKind.CPU.block_dim == 0
    assert LayoutKind.BLOCKS_FIRST.block_dim == 0
    assert LayoutKind.FLASH.block_dim == 1


# --- KvLayout -----------------------------------------------------------------


@pytest.mark.parametrize("kind", [LayoutKind.CPU, LayoutKind.FLASH])
@pytest.mark.parametrize(("dtype", "stride"), [(torch.bfloat16, 256), (torch.float32, 512)])
def test_from_kv_caches(kind: LayoutKind, dtype: torch.dtype, stride: int) -> None:
    kv = random_kv(kind, dtype, layers=3, seed=0)
    layout = KvLayout.from_kv_caches(kv, NUM_BLOCKS)
    assert layout.kind is kind
    assert layout.layer_names == tuple(kv)
    assert layout.dtype == dtype
    per_block = 2 * BLOCK_TOKENS * HEADS * HEAD_SIZE
    assert layout.layer_block_bytes == per_block * dtype.itemsize
    assert layout.layer_stride == stride  # 240 -> 256, 480 -> 512
    assert layout.layer_stride % 64 == 0
    assert layout.block_bytes == 3 * stride


def test_from_kv_caches_explicit_kind_skips_detection() -> None:
    kv = {"a": torch.zeros((2, 2, BLOCK_TOKENS, HEADS, HEAD_SIZE))}  # ambiguous with 2 blocks
    with pytest.raises(ValueError):
        KvLayout.from_kv_caches(kv, 2)
    assert KvLayout.from_kv_caches(kv, 2, LayoutKind.FLASH).kind is LayoutKind.FLASH


def test_from_kv_caches_refuses_mixed_layers() -> None:
    with pytest.raises(ValueError):
        KvLayout.from_kv_caches({}, NUM_BLOCKS)
    base = torch.zeros(shape_of(LayoutKind.CPU))
    other_dtype = torch.zeros(shape_of(LayoutKind.CPU), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer b"):
        KvLayout.from_kv_caches({"a": base, "b": other_dtype}, NUM_BLOCKS)
    other_shape = torch.zeros((NUM_BLOCKS, HEADS, BLOCK_TOKENS, 4))
    with pytest.raises(ValueError, match="layer b"):
        KvLayout.from_kv_caches({"a": base, "b": other_shape}, NUM_BLOCKS)


def test_block_major_is_a_view() -> None:
    t = torch.zeros(shape_of(LayoutKind.FLASH))
    bm = block_major(t, LayoutKind.FLASH)
    assert bm.shape[0] == NUM_BLOCKS
    bm[5] = 1.0
    assert torch.all(t[:, 5] == 1.0)
    assert t.sum() == bm[5].numel()
    cpu = torch.zeros(shape_of(LayoutKind.CPU))
    assert block_major(cpu, LayoutKind.CPU) is cpu


def test_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(num_layers=28, num_kv_heads=8, head_size=128, dtype_bytes=2) == 114688


# --- gather / scatter through a DramTier --------------------------------------


def rank_slots(tier: DramTier, rank: int, layout: KvLayout) -> torch.Tensor:
    # As WorkerSide._attach builds its slot matrix.
    region = tier._slots[:, rank * tier.rank_stride : rank * tier.rank_stride + tier.rank_bytes]
    return slot_matrix(region, layout)


# indexed=True: the accelerator path (one gather and one transfer per layer),
# run here on CPU tensors; None: what a CPU tensor gets (memmove or copy_).
@pytest.mark.parametrize("indexed", [None, True], ids=["cpu-path", "indexed-path"])
@pytest.mark.parametrize("kind", [LayoutKind.CPU, LayoutKind.FLASH])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_bit_exact(make_tier, capacity_for, kind: LayoutKind, dtype: torch.dtype,
                              indexed: bool | None) -> None:
    kv = random_kv(kind, dtype, layers=3, seed=1)
    originals = {n: t.clone() for n, t in kv.items()}
    layout = KvLayout.from_kv_caches(kv, NUM_BLOCKS)
    layers = [block_major(kv[n], kind) for n in layout.layer_names]
    tier = make_tier(capacity_for(6, layout.block_bytes, ranks=2), layout.block_bytes, ranks=2)
    rank = 1  # the second rank's region: offsets must be right, rank 0's bytes untouched
    slots = rank_slots(tier, rank, layout)
    assert slots.shape == (tier.num_slots, 3, layout.layer_stride)
    assert slots.data_ptr() == tier.rank_view(0, rank).data_ptr()

    blocks, slot_ids = [1, 5, 6], [3, 0, 2]
    gather_blocks(layers, layout, blocks, slots, slot_ids, indexed=indexed)

    # Each layer's block sits at its offset in the rank's part of the slot.
    for b, s in zip(blocks, slot_ids):
        part = tier.rank_view(s, rank)
        for i, bm in enumerate(layers):
            off = i * layout.layer_stride
            raw = part[off : off + layout.layer_block_bytes]
            assert torch.equal(raw, bm[b].contiguous().reshape(-1).view(torch.uint8))
            assert torch.all(part[off + layout.layer_block_bytes : off + layout.layer_stride] == 0)
        assert torch.all(tier.rank_view(s, 0) == 0)
    for s in set(range(tier.num_slots)) - set(slot_ids):
        assert torch.all(tier.rank_view(s, rank) == 0)
    # Gathering read the KV and did not write it.
    for n in kv:
        assert torch.equal(bits(kv[n]), bits(originals[n]))

    for bm in layers:
        bm[blocks] = 0
    scatter_blocks(layers, layout, blocks, slots, slot_ids, indexed=indexed)
    for n in kv:
        assert torch.equal(bits(kv[n]), bits(originals[n])), n


def bf16_arena(make_tier, capacity_for, kind: LayoutKind, layers: int, seed: int):
    """Random bf16 KV of ``layers`` layers and a 4-slot arena for it: (kv, layout, block-major layers, tier, slots)."""
    kv = random_kv(kind, torch.bfloat16, layers=layers, seed=seed)
    layout = KvLayout.from_kv_caches(kv, NUM_BLOCKS)
    tier = make_tier(capacity_for(4, layout.block_bytes), layout.block_bytes)
    return kv, layout, [block_major(kv[n], kind) for n in layout.layer_names], tier, rank_slots(tier, 0, layout)


@pytest.mark.parametrize("indexed", [None, True], ids=["cpu-path", "indexed-path"])
@pytest.mark.parametrize("kind", [LayoutKind.CPU, LayoutKind.FLASH])
def test_scatter_writes_only_its_blocks(make_tier, capacity_for, kind: LayoutKind, indexed: bool | None) -> None:
    kv, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, kind, layers=3, seed=2)
    gather_blocks(layers, layout, [2, 3], slots, [0, 1], indexed=indexed)
    before = {n: t.clone() for n, t in kv.items()}
    # Load slot 1 (block 3's contents) into block 7 and slot 0 into block 0.
    scatter_blocks(layers, layout, [7, 0], slots, [1, 0], indexed=indexed)
    for n in layout.layer_names:
        after, prev = block_major(kv[n], kind), block_major(before[n], kind)
        assert torch.equal(bits(after[7]), bits(prev[3]))
        assert torch.equal(bits(after[0]), bits(prev[2]))
        for b in range(1, 7):
            assert torch.equal(bits(after[b]), bits(prev[b])), (n, b)


def test_both_paths_write_the_same_bytes(make_tier, capacity_for) -> None:
    # A block saved by one path is loaded by the other (a CPU process and
    # an accelerator process never share a namespace, but one process may
    # take either path): the slot bytes must not depend on the path.
    for kind in (LayoutKind.CPU, LayoutKind.FLASH):
        _, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, kind, layers=2, seed=4)
        gather_blocks(layers, layout, [4, 2], slots, [0, 1], indexed=False)
        gather_blocks(layers, layout, [4, 2], slots, [2, 3], indexed=True)
        assert torch.equal(tier.rank_view(0), tier.rank_view(2))
        assert torch.equal(tier.rank_view(1), tier.rank_view(3))
        tier.close()


def test_empty_block_lists_are_no_ops(make_tier, capacity_for) -> None:
    kv = random_kv(LayoutKind.CPU, torch.float32, layers=2, seed=3)
    before = {n: t.clone() for n, t in kv.items()}
    layout = KvLayout.from_kv_caches(kv, NUM_BLOCKS)
    layers = [block_major(kv[n], layout.kind) for n in layout.layer_names]
    tier = make_tier(capacity_for(2, layout.block_bytes), layout.block_bytes)
    slots = rank_slots(tier, 0, layout)
    gather_blocks(layers, layout, [], slots, [])
    scatter_blocks(layers, layout, [], slots, [])
    assert torch.all(tier.rank_view(0) == 0) and torch.all(tier.rank_view(1) == 0)
    for n in kv:
        assert torch.equal(bits(kv[n]), bits(before[n]))


def test_sealed_gather_survives_a_reattach(make_tier, shm_path: str, capacity_for) -> None:
    """A block saved and sealed through one mapping loads through another (worker to worker)."""
    kv = random_kv(LayoutKind.FLASH, torch.bfloat16, layers=3, seed=4)
    layout = KvLayout.from_kv_caches(kv, NUM_BLOCKS)
    layers = [block_major(kv[n], layout.kind) for n in layout.layer_names]
    owner = make_tier(capacity_for(3, layout.block_bytes), layout.block_bytes)
    key = bytes(range(16))
    gather_blocks(layers, layout, [4], rank_slots(owner, 0, layout), [2])
    owner.seal(2, key, 0, checksum(owner.rank_view(2, 0), key))

    reader = DramTier.attach(shm_path)
    try:
        assert reader.verify(2, key, 0)
        target = random_kv(LayoutKind.FLASH, torch.bfloat16, layers=3, seed=5)
        t_layers = [block_major(target[n], layout.kind) for n in layout.layer_names]
        slots = rank_slots(reader, 0, layout)
        scatter_blocks(t_layers, layout, [0], slots, [2])
        del slots
        for src, dst in zip(layers, t_layers):
            assert torch.equal(bits(dst[0]), bits(src[4]))
    finally:
        reader.close()


# --- blocks split into kernel blocks (vLLM's prepare_kernel_block_sizes) -----------


def _vllm_views(raw: torch.Tensor, num_blocks: int, layers: int, kernel_block_tokens: int | None,
                block_tokens: int = 16) -> dict[str, torch.Tensor]:
    """vLLM's own per-layer views of one buffer, as its GPU runner makes them
    (allocate_kv_cache -> create_kv_cache_views), optionally split into kernel blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_tokens, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks * layers, layers=[f"l{i}" for i in range(layers)],
                           layer_stride=page * num_blocks, block_stride=page)
    views = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor,
                                  kernel_block_size=kernel_block_tokens)
    return dict(zip(tensor.layers, views))


@pytest.mark.parametrize("kernel_tokens", [8, 4])
def test_blocks_split_into_kernel_blocks_copy_whole_blocks(make_tier, capacity_for, kernel_tokens: int) -> None:
    # Before: from_kv_caches raised "has no dimension of 6 blocks" and the
    # worker failed vLLM's start-up.
    num_blocks, layers = 6, 3
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(-128, 127, (1024 * num_blocks * layers,), dtype=torch.int8, generator=g)
    whole = _vllm_views(raw, num_blocks, layers, None)
    split = _vllm_views(raw, num_blocks, layers, kernel_tokens)
    assert split["l0"].shape[0] == num_blocks * (16 // kernel_tokens)

    layout = KvLayout.from_kv_caches(split, num_blocks, block_tokens=16)
    assert layout.kernel_blocks == 16 // kernel_tokens and layout.dense_blocks
    assert layout.block_bytes == KvLayout.from_kv_caches(whole, num_blocks, block_tokens=16).block_bytes
    tier = make_tier(capacity_for(4, layout.block_bytes), layout.block_bytes)
    slots = rank_slots(tier, 0, layout)
    bm = [layout.block_major(split[n]) for n in layout.layer_names]
    gather_blocks(bm, layout, [4, 1], slots, [0, 1])
    for i, n in enumerate(layout.layer_names):
        # A slot holds vLLM's whole block 4 (all its kernel blocks) as it
        # sits in memory: the same bytes as a slot saved by an unsplit view.
        for slot, block in ((0, 4), (1, 1)):
            assert torch.equal(slots[slot, i, : layout.layer_block_bytes],
                               block_run(block_major(whole[n], LayoutKind.CPU), block).view(torch.uint8))
    before = raw.clone()
    scatter_blocks(bm, layout, [5], slots, [0])  # block 4's bytes into block 5
    for n in layout.layer_names:
        assert torch.equal(bits(whole[n][5]), bits(whole[n][4]))
        for b in range(5):
            assert torch.equal(bits(whole[n][b]), bits(_vllm_views(before, num_blocks, layers, None)[n][b]))


def test_a_shape_that_is_no_whole_split_is_refused() -> None:
    # 12 rows of 8 tokens for 6 blocks of 32 tokens: not a split of them.
    with pytest.raises(ValueError, match="kernel blocks"):
        KvLayout.from_kv_caches({"l0": torch.zeros(12, 2, 8, 16)}, 6, block_tokens=32)
    with pytest.raises(ValueError):
        KvLayout.from_kv_caches({"l0": torch.zeros(12, 2, 8, 16)}, 6)  # tokens per block unknown: no guess


def test_layers_with_other_strides_are_refused() -> None:
    # Before: only shapes and dtypes were compared, and layer 0's contiguity
    # chose the memmove path for every layer.
    base = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE)
    strided = torch.zeros(NUM_BLOCKS, BLOCK_TOKENS, HEADS, 2 * HEAD_SIZE).transpose(1, 2)
    assert strided.shape == base.shape and not strided[0].is_contiguous()
    with pytest.raises(ValueError, match="strides"):
        KvLayout.from_kv_caches({"a": base, "b": strided}, NUM_BLOCKS)
    # A block that is one run of memory in another dimension order is dense;
    # one with gaps is not.
    assert KvLayout.from_kv_caches({"a": strided}, NUM_BLOCKS).dense_blocks
    gaps = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_TOKENS, 4 * HEAD_SIZE)[..., : 2 * HEAD_SIZE]
    assert not KvLayout.from_kv_caches({"a": gaps}, NUM_BLOCKS).dense_blocks


def test_scatter_checked_copies_like_scatter_and_checks_each_block_once_copied(make_tier, capacity_for) -> None:
    # The CPU load path: each block's layers, then its check, block by block.
    # Same bytes as scatter_blocks; the check of block i runs once block i
    # is whole in vLLM's tensors; what it refuses comes back by position.
    kind = LayoutKind.CPU
    kv, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, kind, layers=3, seed=5)
    assert can_check_while_copying(layers, layout)
    # A layout whose blocks are not one run each (K and V planes apart) takes the other path.
    fkv = random_kv(LayoutKind.FLASH, torch.bfloat16, layers=2, seed=6)
    flash = KvLayout.from_kv_caches(fkv, NUM_BLOCKS)
    assert not can_check_while_copying([block_major(fkv[n], LayoutKind.FLASH) for n in flash.layer_names], flash)
    gather_blocks(layers, layout, [2, 3, 5], slots, [0, 1, 2])
    before = {n: t.clone() for n, t in kv.items()}
    for bm in layers:
        bm[[7, 0, 4]] = 0
    seen = []

    def check(i: int) -> bool:
        b = [7, 0, 4][i]
        seen.append(i)
        for n in layout.layer_names:  # this block is already copied, in every layer
            assert torch.equal(bits(block_major(kv[n], kind)[b]), bits(block_major(before[n], kind)[[2, 3, 5][i]]))
        return i != 1

    assert scatter_checked(layers, layout, [7, 0, 4], slots, [0, 1, 2], check) == [1]
    assert seen == [0, 1, 2]
    for n in layout.layer_names:
        after, prev = block_major(kv[n], kind), block_major(before[n], kind)
        for b, src in ((7, 2), (0, 3), (4, 5)):
            assert torch.equal(bits(after[b]), bits(prev[src]))
        for b in (1, 2, 3, 5, 6):
            assert torch.equal(bits(after[b]), bits(prev[b]))


def test_gather_sealed_writes_what_gather_blocks_writes_and_seals_each_slot_once_written(make_tier,
                                                                                         capacity_for) -> None:
    # The CPU save path: each block's layers into its slot, then its seal
    # (checksum and header), block by block.
    kv, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, LayoutKind.CPU, layers=3, seed=7)
    blocks, slot_ids = [6, 1, 3], [2, 0, 3]
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    expected = torch.zeros(tier.num_slots, tier.rank_bytes, dtype=torch.uint8)  # what gather_blocks writes
    gather_blocks(layers, layout, blocks, slot_matrix(expected, layout), slot_ids)
    sealed = []

    def seal(i: int) -> None:
        s = slot_ids[i]
        assert torch.equal(tier.rank_view(s, 0), expected[s])  # the slot is whole when sealed
        assert all(torch.all(tier.rank_view(t, 0) == 0) for t in slot_ids[i + 1:])  # later ones not yet copied
        tier.seal(s, keys[i], 0, checksum(tier.rank_view(s, 0), keys[i]))
        sealed.append(i)

    gather_sealed(layers, layout, blocks, slots, slot_ids, seal)
    assert sealed == [0, 1, 2]
    for i, s in enumerate(slot_ids):
        assert torch.equal(tier.rank_view(s, 0), expected[s])
        assert tier.verify(s, keys[i], 0)
    assert torch.all(tier.rank_view(1, 0) == 0)  # a slot it was not given


def test_the_runs_a_save_meant_to_write_hash_as_the_slot_they_were_copied_into(make_tier, capacity_for) -> None:
    # Three layers of 240 bytes in parts of 256: the runs interleave vLLM's
    # blocks with the slot's padding, and the slot's tail after the last
    # layer, so their checksum is the checksum of the whole rank part.
    kv, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, LayoutKind.CPU, layers=3, seed=9)
    assert layout.layer_stride > layout.layer_block_bytes
    tier.rank_view(2, 0).fill_(0xA5)  # padding bytes that no save writes, hashed as they are
    key = b"r" * 16
    gather_sealed(layers, layout, [5], slots, [2], lambda i: None)
    runs = written_runs(layers, layout, tier.rank_bytes)(5, tier.rank_view(2, 0).data_ptr())
    assert len(runs) == 6 and sum(len(r) for r in runs) == tier.rank_bytes  # 3 layers, 3 gaps
    assert b"".join(bytes(r) for r in runs) == tier.rank_view(2, 0).numpy().tobytes()
    assert checksum_runs(runs, key) == checksum(tier.rank_view(2, 0), key)


def test_a_late_writer_between_a_block_s_copy_and_its_seal_leaves_a_slot_that_fails(make_tier,
                                                                                     capacity_for) -> None:
    # A worker of an ended session, whose slot went to this block meanwhile,
    # writes its bytes right after this block's copy. Sealed with the
    # checksum of what the copy read, the slot fails its check (a miss);
    # sealed with the checksum of the slot, it would pass with the late
    # writer's bytes under this block's key.
    kv, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, LayoutKind.CPU, layers=2, seed=10)
    key = b"n" * 16
    late = torch.randint(0, 256, (tier.rank_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    def seal(i: int) -> None:
        part = tier.rank_view(1, 0)
        part.copy_(late)  # the late writer's copy lands here
        tier.seal(1, key, 0, checksum_runs(written_runs(layers, layout, tier.rank_bytes)(3, part.data_ptr()), key))

    gather_sealed(layers, layout, [3], slots, [1], seal)
    assert tier.is_sealed(1, key)
    assert not tier.verify(1, key, 0)
    tier.seal(1, key, 0, checksum(tier.rank_view(1, 0), key))  # what a checksum of the slot would seal
    assert tier.verify(1, key, 0)


def test_gather_sealed_stops_at_a_failing_seal(make_tier, capacity_for) -> None:
    kv, layout, layers, tier, slots = bf16_arena(make_tier, capacity_for, LayoutKind.CPU, layers=2, seed=8)
    key = b"k" * 16

    def seal(i: int) -> None:
        if i == 1:
            raise OSError("header write failed")
        tier.seal(i, key, 0, checksum(tier.rank_view(i, 0), key))

    with pytest.raises(OSError, match="header write failed"):
        gather_sealed(layers, layout, [4, 5, 6], slots, [0, 1, 2], seal)
    assert tier.verify(0, key, 0)  # sealed before the failure: whole
    assert not tier.is_sealed(1, key) and not tier.is_sealed(2, key)
    assert torch.all(tier.rank_view(2, 0) == 0)  # never reached


# --- the device-kernel path (copy.indexed_gather / indexed_scatter) -----------------
#
# On CUDA the slot matrix is also a device tensor over the mapped arena and a
# step's blocks of a layer move in one index_copy_; run here on CPU tensors
# (the slot matrix itself), the bytes must be those of the per-block path.


def _layouts_for_kernels() -> dict[str, tuple[dict[str, torch.Tensor], int | None]]:
    """name -> (per-layer KV views, tokens per block when blocks are split into kernel blocks)."""
    g = torch.Generator().manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(-(1 << 15), (1 << 15) - 1, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)

    out: dict[str, tuple[dict[str, torch.Tensor], int | None]] = {
        "cpu": ({f"l{i}": rand(*shape_of(LayoutKind.CPU)) for i in range(3)}, None),
        "flash": ({f"l{i}": rand(*shape_of(LayoutKind.FLASH)) for i in range(3)}, None),
        # dense blocks in another dimension order (vLLM's LBNHC): a block's run, not its view order
        "heads-inner": ({f"l{i}": rand(NUM_BLOCKS, BLOCK_TOKENS, HEADS, 2 * HEAD_SIZE).transpose(1, 2)
                         for i in range(3)}, None),
        # blocks with gaps (not dense): the view's order
        "gaps": ({f"l{i}": rand(NUM_BLOCKS, HEADS, BLOCK_TOKENS, 4 * HEAD_SIZE)[..., : 2 * HEAD_SIZE]
                  for i in range(3)}, None),
    }
    raw = torch.randint(-128, 127, (1024 * NUM_BLOCKS * 3,), dtype=torch.int8, generator=g)
    out["kernel-blocks"] = (_vllm_views(raw, NUM_BLOCKS, 3, 4), 16)
    return out


@pytest.mark.parametrize("chunk", [None, 3], ids=["one-chunk", "chunks-of-3-blocks"])
@pytest.mark.parametrize("name", ["cpu", "flash", "heads-inner", "gaps", "kernel-blocks"])
def test_the_kernel_path_writes_and_reads_the_per_block_path_s_bytes(make_tier, capacity_for, name: str,
                                                                    chunk: int | None) -> None:
    from kvtier.connector import copy as copy_module

    def indexed_gather(*args) -> None:  # noqa: ANN002 - the copy module's, in chunks of ``chunk`` blocks
        copy_module.indexed_gather(*args, max_bytes=chunk * layout.layer_block_bytes if chunk else 1 << 30)

    def indexed_scatter(*args) -> None:  # noqa: ANN002
        copy_module.indexed_scatter(*args, max_bytes=chunk * layout.layer_block_bytes if chunk else 1 << 30)

    kv, block_tokens = _layouts_for_kernels()[name]
    layout = KvLayout.from_kv_caches(kv, NUM_BLOCKS, block_tokens=block_tokens)
    bm = [layout.block_major(kv[n]) for n in layout.layer_names]
    originals = [bits(t).clone() for t in bm]
    tier = make_tier(capacity_for(8, layout.block_bytes, ranks=2), layout.block_bytes, ranks=2)
    slots = rank_slots(tier, 1, layout)  # the second rank's part of each slot: offsets must be right
    blocks, by_blocks, by_kernel = [5, 0, 7, 2], [0, 1, 2, 3], [6, 4, 7, 5]
    gather_blocks(bm, layout, blocks, slots, by_blocks)
    b_idx, s_idx = torch.tensor(blocks), torch.tensor(by_kernel)
    for i, t in enumerate(bm):
        indexed_gather(t, layout, b_idx, slots, s_idx, i)
    for a, b in zip(by_blocks, by_kernel):
        assert torch.equal(tier.rank_view(a, 1), tier.rank_view(b, 1)), (a, b)
    for s in range(8):
        assert torch.all(tier.rank_view(s, 0) == 0)  # rank 0's parts untouched
    for t in bm:
        t[blocks] = 0
    # Loaded by the kernel path into other blocks too: 5's bytes into 1, 2's into 6.
    for i, t in enumerate(bm):
        indexed_scatter(t, layout, torch.tensor([5, 0, 7, 2, 1, 6]), slots, torch.tensor([6, 4, 7, 5, 6, 5]), i)
    for t, o in zip(bm, originals):
        assert torch.equal(bits(t)[[5, 0, 7, 2, 3, 4]], o[[5, 0, 7, 2, 3, 4]])
        assert torch.equal(bits(t)[1], o[5]) and torch.equal(bits(t)[6], o[2])
    for s in range(4, 8):  # the kernel path never writes past a layer's block in a slot
        for i in range(len(bm)):
            assert torch.all(slots[s, i, layout.layer_block_bytes :] == 0)


def test_ids_outside_the_tensors_are_refused_before_any_kernel() -> None:
    from kvtier.connector.copy import checked_ids

    checked_ids([0, 3, 7], 8, "slot")
    checked_ids([], 0, "slot")
    with pytest.raises(ValueError, match="slot 8 is outside"):
        checked_ids([0, 8], 8, "slot")
    with pytest.raises(ValueError, match="block -1 is outside"):
        checked_ids([-1], 8, "block")
