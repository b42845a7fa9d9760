"""The worker's device-copy path on a real GPU, through both copy paths:
kernels over the mapped arena (the default once the arena is registered)
and one DMA per block and layer (``KVTIER_CUDA_COPY=blocks``).

Real parts only: a CUDA device, vLLM-shaped KV tensors on it, an arena in
/dev/shm, the worker half as vLLM's runner calls it, real streams. Where
the order of work on two streams matters, ``torch.cuda._sleep`` holds one
stream back, so that a missing wait shows as wrong bytes rather than
depending on luck.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.connector import worker as worker_module
from kvtier.connector.copy import StreamCopies, gather_blocks, slot_matrix
from kvtier.connector.meta import BlockCopy, StepPlan
from kvtier.connector.worker import WorkerSide
from kvtier.layout import LayoutKind
from kvtier.tier.dram import DramTier, checksum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA torch")

NUM_BLOCKS, LAYERS, TOKENS, HEADS, HEAD = 96, 4, 16, 8, 128  # 64 KiB a block and layer (bf16), an 8B model's
SLOTS = 48
HOLD = 500_000_000  # GPU cycles a stream is held back (~0.25 s): far longer than any copy or host step here
KEYS = [bytes([i]) * 16 for i in range(1, 60)]


def random_kv(kind: LayoutKind, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = ((2, NUM_BLOCKS, TOKENS, HEADS, HEAD) if kind is LayoutKind.FLASH
             else (NUM_BLOCKS, HEADS, TOKENS, 2 * HEAD))
    return {f"model.layers.{i}.self_attn.attn": torch.randint(-(1 << 15), (1 << 15) - 1, shape, dtype=torch.int16,
                                                              generator=g).cuda().view(torch.bfloat16)
            for i in range(LAYERS)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture(params=["mapped", "blocks"])
def path(request, monkeypatch) -> str:
    monkeypatch.setattr(worker_module, "KERNEL_COPIES", request.param == "mapped")
    return request.param


@pytest.fixture(params=[LayoutKind.BLOCKS_FIRST, LayoutKind.FLASH], ids=["blocks-first", "flash"])
def kind(request) -> LayoutKind:
    return request.param


def run_step(w: WorkerSide, plan: StepPlan, forward=None):  # noqa: ANN001
    """One engine step as vLLM's runner calls the worker: loads, then per
    layer wait for its load, ``forward(i)`` (the attention that writes the
    layer's KV) and its saves; returns (load errors, report)."""
    w.start_load_kv(plan)
    for i, name in enumerate(w.layout.layer_names):
        w.wait_for_layer_load(name)
        if forward is not None:
            forward(i)
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)
    errors = w.get_block_ids_with_load_errors()
    return errors, w.build_report()


class Rig:
    """A worker on the GPU, its KV and an arena, stepped as vLLM's runner steps it."""

    def __init__(self, shm_path: str, kind: LayoutKind, path: str) -> None:
        self.kv = random_kv(kind, seed=1)
        self.worker = w = WorkerSide(rank=0, num_blocks=NUM_BLOCKS, kind=kind, block_tokens=TOKENS)
        w.register_kv_caches(self.kv)
        assert w.layout is not None and w._copies is not None
        self.layout = w.layout
        self.bm = w._layers  # block-major views of the KV tensors
        block = self.layout.block_bytes
        self.tier = DramTier.create(shm_path, (block + 8192) * SLOTS + (1 << 20), block)
        self.step_no = 0
        assert w._attach(self.tier.path)
        w._pinning.join()  # registered on its own thread; wait for it here
        assert w._pinned is not None, "the arena could not be pinned"
        assert w._copies.mapped is (path == "mapped")

    def plan(self, loads=(), saves=()) -> StepPlan:
        self.step_no += 1
        return StepPlan(step=self.step_no, arena=self.tier.path, loads=list(loads), saves=list(saves))

    def step(self, plan: StepPlan, forward=None):  # noqa: ANN001
        return run_step(self.worker, plan, forward)

    def settle(self) -> tuple[set[int], list[int]]:
        """Empty steps until every held report is out (the copies done):
        (the steps reported, the slots reported failed)."""
        done: set[int] = set()
        failed: list[int] = []
        for _ in range(50):
            torch.cuda.synchronize()
            _, report = self.step(self.plan())
            if report is not None:
                done.update(report.done)
                failed.extend(report.failed_slots)
            if not self.worker._held:
                return done, failed
        raise AssertionError("reports still held after the copies ended")

    def seal_for_load(self, slot: int, key: bytes, fill: int) -> torch.Tensor:
        """A slot holding ``key`` as the pool publishes one: bytes, seal, publish; its bytes."""
        self.tier.clear(slot, key)
        part = self.tier.rank_view(slot, 0)
        part.fill_(fill)
        self.tier.seal(slot, key, 0, checksum(part, key))
        self.tier.publish(slot)
        return part.clone()

    def close(self) -> None:
        self.worker.shutdown()
        self.tier.close()


@pytest.fixture
def rig(shm_path, kind, path):
    r = Rig(shm_path, kind, path)
    yield r
    r.close()


def test_saved_blocks_hold_the_bytes_the_cpu_path_writes_and_load_back_bit_exact(rig) -> None:
    blocks, slots = [3, 95, 0, 41, 17], [0, 47, 9, 10, 2]
    saves = [BlockCopy(b, s, KEYS[i]) for i, (b, s) in enumerate(zip(blocks, slots))]
    errors, report = rig.step(rig.plan(saves=saves))
    assert errors == set()
    done, failed = rig.settle()
    assert 1 in done | set(report.done if report else ()) and failed == []
    for c in saves:
        assert rig.tier.verify(c.slot, c.key, 0), c  # sealed with the checksum of the bytes it holds
    # The same slot bytes as the CPU path writes from a host copy of the KV.
    cpu_bm = [t.cpu() for t in rig.bm]
    expected = torch.zeros(SLOTS, LAYERS, rig.layout.layer_stride, dtype=torch.uint8)
    gather_blocks(cpu_bm, rig.layout, blocks, expected, list(range(len(blocks))))
    got = slot_matrix(rig.tier._slots[:, : rig.tier.rank_bytes], rig.layout)
    for i, s in enumerate(slots):
        assert torch.equal(got[s, :, : rig.layout.layer_block_bytes], expected[i, :, : rig.layout.layer_block_bytes])

    for s in slots:
        rig.tier.publish(s)
    into = [60, 61, 3, 90, 5]  # block 3 is loaded with slot 10's bytes (block 41's)
    originals = [bits(t).clone() for t in rig.bm]
    for t in rig.bm:
        t[into] = 0
    loads = [BlockCopy(b, s, KEYS[i]) for i, (b, s) in enumerate(zip(into, slots))]
    errors, _ = rig.step(rig.plan(loads=loads))
    torch.cuda.synchronize()
    assert errors == set()
    for t, o in zip(rig.bm, originals):
        assert torch.equal(bits(t)[into], o[blocks])
        others = [b for b in range(NUM_BLOCKS) if b not in into]
        assert torch.equal(bits(t)[others], o[others])  # nothing else written
    rig.settle()


def test_a_save_reads_the_layer_after_the_attention_that_wrote_it(rig) -> None:
    """The attention is held back on vLLM's stream, then writes the block:
    the save (queued right after, on its own stream) must copy what it wrote."""
    saves = [BlockCopy(7, 4, KEYS[0]), BlockCopy(8, 5, KEYS[1])]

    def forward(i: int) -> None:
        torch.cuda._sleep(HOLD)
        rig.bm[i][7] = 1.0
        rig.bm[i][8] = -2.0

    rig.step(rig.plan(saves=saves), forward)
    assert rig.settle()[1] == []
    for c, value in ((saves[0], 1.0), (saves[1], -2.0)):
        assert rig.tier.verify(c.slot, c.key, 0)
        slot = slot_matrix(rig.tier._slots[:, : rig.tier.rank_bytes], rig.layout)[c.slot]
        for i in range(LAYERS):
            got = slot[i, : rig.layout.layer_block_bytes].view(torch.bfloat16)
            assert torch.all(got == value), (c, i)


def test_the_next_step_writes_a_block_only_after_the_saves_read_it(rig) -> None:
    """Saves held back on their stream; the next step's kernels overwrite
    the saved blocks (vLLM freed and reused them): the slots keep the old bytes."""
    before = [bits(t)[[9, 10]].clone() for t in rig.bm]
    saves = [BlockCopy(9, 0, KEYS[0]), BlockCopy(10, 1, KEYS[1])]
    with torch.cuda.stream(rig.worker._copies.stream):
        torch.cuda._sleep(HOLD)
    rig.step(rig.plan(saves=saves))
    for t in rig.bm:  # the next step's forward, on vLLM's stream
        t[9:11] = 3.0
    assert rig.settle()[1] == []
    slots = slot_matrix(rig.tier._slots[:, : rig.tier.rank_bytes], rig.layout)
    for c, row in zip(saves, range(2)):
        assert rig.tier.verify(c.slot, c.key, 0)
        for i in range(LAYERS):
            # (Both layouts here hold a block in its view's order: the memory
            # order of a blocks-first block, and flash's non-dense block.)
            want = before[i][row].contiguous().view(torch.uint8).reshape(-1).cpu()
            assert torch.equal(slots[c.slot, i, : rig.layout.layer_block_bytes], want), (c, i)


# Two blocks or more in each step below: a single block goes by DMA on both
# paths (copy.KERNEL_MIN_BLOCKS), and these must run the kernels too. While
# a stream is held back, blocks are named by slices, never by lists: a list
# index is copied to the device by a copy that waits for the held stream.


def test_a_layer_is_read_only_after_its_load(rig) -> None:
    """Loads held back on their stream: the forward (vLLM's stream) reads
    each layer only once that layer's load has landed."""
    parts = [rig.seal_for_load(3, KEYS[5], fill=0x3F), rig.seal_for_load(4, KEYS[6], fill=0x40)]
    with torch.cuda.stream(rig.worker._copies.stream):
        torch.cuda._sleep(HOLD)
    seen = []
    errors, _ = rig.step(rig.plan(loads=[BlockCopy(20, 3, KEYS[5]), BlockCopy(21, 4, KEYS[6])]),
                         forward=lambda i: seen.append(rig.bm[i][20:22].clone()))
    torch.cuda.synchronize()
    assert errors == set() and len(seen) == LAYERS
    want = [p[: rig.layout.layer_block_bytes].view(torch.bfloat16)[0].item() for p in parts]  # 0.7461, 3.0
    for i, blocks in enumerate(seen):
        assert torch.all(blocks[0] == want[0]) and torch.all(blocks[1] == want[1]), i
    rig.settle()


def test_a_load_lands_after_the_writes_vllm_queued_before_it(rig) -> None:
    """vLLM's stream held back, then a write to the blocks (an earlier step's
    work, still queued): the load into them lands after it, not under it."""
    parts = [rig.seal_for_load(3, KEYS[5], fill=0x3F), rig.seal_for_load(4, KEYS[6], fill=0x40)]
    torch.cuda._sleep(HOLD)
    for t in rig.bm:
        t[20:22] = 5.0
    errors, _ = rig.step(rig.plan(loads=[BlockCopy(20, 3, KEYS[5]), BlockCopy(21, 4, KEYS[6])]))
    torch.cuda.synchronize()
    assert errors == set()
    want = [p[: rig.layout.layer_block_bytes].view(torch.bfloat16)[0].item() for p in parts]
    for t in rig.bm:
        assert torch.all(t[20] == want[0]) and torch.all(t[21] == want[1])
    rig.settle()


@pytest.mark.parametrize("refill", [KEYS[1], KEYS[0]], ids=["another key", "the same key"])
def test_a_slot_reused_before_its_dma_ran_is_a_load_error(rig, refill: bytes) -> None:
    rig.seal_for_load(6, KEYS[0], fill=1)
    rig.seal_for_load(8, KEYS[7], fill=3)
    with torch.cuda.stream(rig.worker._copies.stream):
        torch.cuda._sleep(HOLD)  # the copies run late
    w = rig.worker
    w.start_load_kv(rig.plan(loads=[BlockCopy(30, 6, KEYS[0]), BlockCopy(32, 8, KEYS[7])]))
    rig.seal_for_load(6, refill, fill=2)  # the pin lost, the slot given to another save meanwhile
    for name in rig.layout.layer_names:
        w.wait_for_layer_load(name)
    assert w.get_block_ids_with_load_errors() == {30}  # block 32's slot was left alone
    assert w._report.corrupt_keys == []  # reused, not corrupt
    w.build_report()
    rig.settle()


def test_a_slot_whose_bytes_changed_after_its_seal_is_corrupt(rig) -> None:
    rig.seal_for_load(7, KEYS[3], fill=4)
    rig.seal_for_load(9, KEYS[8], fill=6)
    rig.tier.rank_view(7, 0)[100] = 5  # a flipped byte: same header, other bytes
    w = rig.worker
    w.start_load_kv(rig.plan(loads=[BlockCopy(31, 7, KEYS[3]), BlockCopy(33, 9, KEYS[8])]))
    for name in rig.layout.layer_names:
        w.wait_for_layer_load(name)
    assert w.get_block_ids_with_load_errors() == {31}
    assert w._report.corrupt_keys == [KEYS[3]]
    w.build_report()
    rig.settle()


def test_a_new_arena_is_mapped_and_the_old_released_with_copies_in_flight(rig, shm_path, path) -> None:
    with torch.cuda.stream(rig.worker._copies.stream):
        torch.cuda._sleep(HOLD)
    rig.step(rig.plan(saves=[BlockCopy(1, 0, KEYS[0]), BlockCopy(3, 2, KEYS[2])]))  # queued behind the hold
    new = DramTier.create(shm_path + "-new", (rig.layout.block_bytes + 8192) * 8 + (1 << 20),
                          rig.layout.block_bytes)
    try:
        plan = StepPlan(step=rig.step_no + 1, arena=new.path,
                        saves=[BlockCopy(2, 1, KEYS[1]), BlockCopy(4, 3, KEYS[3])])
        rig.step_no += 1
        _, report = rig.step(plan)  # maps the new arena: the old one's copies end before it is released
        rig.worker._pinning.join()
        assert rig.worker._copies.mapped is (path == "mapped")
        rig.tier, old = new, rig.tier
        done, failed = rig.settle()
        if report is not None:
            done |= set(report.done)
            failed = report.failed_slots + failed
        assert failed == [0, 2] and {1, 2} <= done  # step 1's saves into the old arena failed, step 2's hold
        assert new.verify(1, KEYS[1], 0) and new.verify(3, KEYS[3], 0)
        assert not old.is_sealed(0, KEYS[0])  # its step's saves fail: another arena is mapped
        old.close()
    finally:
        rig.worker._close_arena()


def test_ids_outside_the_kv_or_the_arena_are_refused_before_a_kernel_runs(rig, path) -> None:
    if path != "mapped":
        pytest.skip("the kernel path's check")
    copies: StreamCopies = rig.worker._copies
    slots = rig.worker._slots
    with pytest.raises(ValueError, match="block 96 is outside"):
        copies.save_layer(0, rig.bm[0], rig.layout, [1, NUM_BLOCKS], slots, [0, 1])
    with pytest.raises(ValueError, match="slot -1 is outside"):
        copies.load(rig.bm, rig.layout, [1, 2], slots, [0, -1])
    torch.cuda.synchronize()  # the context is intact: no device-side assert
    copies.save_layer(0, rig.bm[0], rig.layout, [1, 2], slots, [0, 1])
    torch.cuda.synchronize()


def test_two_ranks_save_their_parts_of_each_slot_and_load_them_back(shm_path, path) -> None:
    """Tensor parallelism on one device: two workers (ranks 0 and 1, KV of
    their own) map one arena of two ranks; each writes and reads its own
    part of the same slots."""
    kind = LayoutKind.BLOCKS_FIRST
    workers = []
    for rank in range(2):
        w = WorkerSide(rank=rank, num_blocks=NUM_BLOCKS, kind=kind, block_tokens=TOKENS)
        w.register_kv_caches(random_kv(kind, seed=10 + rank))
        workers.append(w)
    block = workers[0].layout.block_bytes
    tier = DramTier.create(shm_path, (2 * block + 8192) * 8 + (1 << 20), block, ranks=2)
    try:
        for w in workers:
            assert w._attach(tier.path)
            w._pinning.join()
            assert w._copies.mapped is (path == "mapped")
        saves = [BlockCopy(5, 1, KEYS[0]), BlockCopy(6, 2, KEYS[1]), BlockCopy(9, 3, KEYS[2])]
        first = [run_step(w, StepPlan(step=1, arena=tier.path, saves=saves))[1] for w in workers]
        torch.cuda.synchronize()
        for w, early in zip(workers, first):
            _, later = run_step(w, StepPlan(step=2, arena=tier.path))
            report = early or later  # out at once if the copies were done by then, else with step 2
            assert report is not None and 1 in report.done and report.failed_slots == []
        for c in saves:
            assert tier.verify(c.slot, c.key, 0) and tier.verify(c.slot, c.key, 1)
            tier.publish(c.slot)
        originals = [[bits(t).clone() for t in w._layers] for w in workers]
        into = [40, 41, 42]
        for w in workers:
            for t in w._layers:
                t[into] = 0
        loads = [BlockCopy(b, c.slot, c.key) for b, c in zip(into, saves)]
        for w in workers:
            errors, _ = run_step(w, StepPlan(step=3, arena=tier.path, loads=loads))
            assert errors == set()
        torch.cuda.synchronize()
        for w, before in zip(workers, originals):
            for t, o in zip(w._layers, before):
                assert torch.equal(bits(t)[into], o[[5, 6, 9]])
        assert not torch.equal(bits(workers[0]._layers[0])[40], bits(workers[1]._layers[0])[40])  # parts of their own
    finally:
        for w in workers:
            w.shutdown()
        tier.close()
