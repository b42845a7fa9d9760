"""One-step check of kvtier's CUDA copy path, for a machine with an NVIDIA GPU.

Run ``scripts/gpu_check.sh`` (or ``PYTHONPATH=src python3 bench/gpu_check.py``).
Needs only a CUDA torch (2.11 or newer), numpy and xxhash; installs nothing
and needs no network. In a few minutes it checks:

1. bit-exact round trips between vLLM's paged KV layouts on the GPU and
   DRAM arena slots (random bit patterns, NaNs included): blocks saved
   through ``copy.StreamCopies`` (device -> pinned arena, on its own
   stream) and loaded back layer by layer (arena -> device) equal the
   original bits; for dense layouts the slot bytes equal what the CPU path
   writes for the same tensor, and a layout split into kernel blocks writes
   the same slot bytes as the unsplit one;
   each layout also goes through the kernel path (``index_copy_`` over the
   arena mapped into the device, ``copy.device_slot_view``), whose slot
   bytes must equal the DMA path's;
2. device-to-host and host-to-device GB/s of both copy paths (one DMA per
   block and layer; one kernel per layer) against a plain ``copy_`` of the
   same bytes between one pinned host tensor and one device tensor, in the
   same run (goal: >= 0.8x), and the host time the copies take on the
   calling thread (vLLM's);
3. with ``--e2e`` and a CUDA build of vLLM importable: a test model served
   with kvtier on the GPU gives the same greedy output for a prompt loaded
   from the DRAM tier (after eviction) as for vLLM's own device prefix hit.

Prints one summary line last: ``gpu_check: PASS ...`` or ``gpu_check: FAIL ...``;
exits 0 on PASS.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid

import torch

import kvtier.connector.copy as copy_module
from kvtier.connector.copy import StreamCopies, device_slot_view, gather_blocks, slot_matrix
from kvtier.hostmem import mapped_at_host_address, pin_host_memory
from kvtier.layout import KvLayout, LayoutKind
from kvtier.tier.dram import DramTier


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    ints = {2: torch.int16, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, dtype=ints, generator=g).to(device).view(dtype)


def layouts(num_blocks: int, layers: int, block_tokens: int, heads: int, head: int) -> dict:
    """Per-layer KV views as vLLM makes them, over one buffer each: name -> (views, kind, kernel split)."""
    out = {}
    dev = "cuda"
    c = 2 * head  # K and V of a token, vLLM's logical content dimension

    def over(buf: torch.Tensor, shape, stride, per_layer: int):
        return {f"l{i}": buf.as_strided(shape, stride, i * per_layer) for i in range(layers)}

    n = num_blocks * heads * block_tokens * c
    buf = random_bits((layers * n,), torch.bfloat16, dev, 1)
    # [B, H, N, C] in memory order B, H, N, C (LBHNC)
    out["LBHNC"] = (over(buf, (num_blocks, heads, block_tokens, c),
                         (heads * block_tokens * c, block_tokens * c, c, 1), n), None, 1)
    # [B, H, N, C] in memory order B, N, H, C (LBNHC): dense blocks, another order
    out["LBNHC"] = (over(buf, (num_blocks, heads, block_tokens, c),
                         (heads * block_tokens * c, c, heads * c, 1), n), None, 1)
    # LBNHC split into kernel blocks of a quarter of the tokens
    k = 4
    out["LBNHC/kernel4"] = (over(buf, (num_blocks * k, heads, block_tokens // k, c),
                                 (heads * block_tokens // k * c, c, heads * c, 1), n), None, k)
    # [H, B, N, C] per layer (LHBNC): a block is not one run of memory
    out["LHBNC"] = (over(buf, (num_blocks, heads, block_tokens, c),
                         (block_tokens * c, num_blocks * block_tokens * c, c, 1), n), None, 1)
    # older flash-attention shape (2, B, N, H, D)
    out["flash(2,B,N,H,D)"] = (over(buf, (2, num_blocks, block_tokens, heads, head),
                                    (num_blocks * block_tokens * heads * head, block_tokens * heads * head,
                                     heads * head, head, 1), n), LayoutKind.FLASH, 1)
    return out


def arena(layout: KvLayout, num_slots: int, folder: str
          ) -> tuple[DramTier, torch.Tensor, object, torch.Tensor | None]:
    """(tier, slot matrix, pinned region or None, the matrix as a device tensor or None)."""
    path = os.path.join(folder, f"kvtier-gpu-check-{uuid.uuid4().hex}")
    tier = DramTier.create(path, (layout.block_bytes + 8192) * (num_slots + 2) + (1 << 20), layout.block_bytes)
    pinned, why = pin_host_memory(tier._slots.data_ptr(), tier._slots.numel(), unit=tier.slot_stride)
    if pinned is None:
        print(f"  note: arena not pinned ({why}); copies go through pageable memory")
    slots = slot_matrix(tier._slots[:, : tier.rank_bytes], layout)
    mapped = None
    if pinned is not None:
        ok, why = mapped_at_host_address(pinned)
        if ok:
            mapped = device_slot_view(slots, torch.device("cuda"))
        else:
            print(f"  note: arena not mapped into the device ({why}); no kernel path")
    return tier, slots, pinned, mapped


def round_trips(folder: str) -> tuple[list[str], int, int]:
    """(failures, layout x path runs that passed, runs tried)."""
    failures: list[str] = []
    passed = tried = 0
    num_blocks, layers, block_tokens, heads, head = 32, 3, 16, 4, 64
    reference_slots: dict[str, torch.Tensor] = {}
    for name, (kv, kind, split) in layouts(num_blocks, layers, block_tokens, heads, head).items():
        layout = KvLayout.from_kv_caches(kv, num_blocks, kind, block_tokens=block_tokens)
        assert layout.kernel_blocks == split, (name, layout)
        bm = [layout.block_major(kv[n]) for n in layout.layer_names]
        original = [t.clone() for t in bm]
        tier, slots, pinned, mapped = arena(layout, 16, folder)
        blocks, slot_ids = [3, 17, 0, 31, 8], [0, 5, 2, 9, 15]
        by_path: dict[str, torch.Tensor] = {}
        for path in ("dma", "kernel"):
            label = f"{name} {path}"
            if path == "kernel" and mapped is None:
                failures.append(f"{label}: the arena could not be mapped into the device")
                continue
            copies = StreamCopies(torch.device("cuda"))
            if path == "kernel":
                copies.map_slots(slots, mapped)
            slots.zero_()
            for i, t in enumerate(bm):
                copies.save_layer(i, t, layout, blocks, slots, slot_ids)
            copies.end_saves().synchronize()
            got = slots[slot_ids, :, : layout.layer_block_bytes].clone()
            by_path[path] = got
            if layout.dense_blocks:
                # The CPU path writes the same bytes from a host copy of the tensor.
                cpu_kv = {n: t.cpu() for n, t in kv.items()}
                cpu_layout = KvLayout.from_kv_caches(cpu_kv, num_blocks, kind, block_tokens=block_tokens)
                cpu_slots = torch.zeros(16, layers, layout.layer_stride, dtype=torch.uint8)
                gather_blocks([cpu_layout.block_major(cpu_kv[n]) for n in cpu_layout.layer_names], cpu_layout,
                              blocks, cpu_slots, slot_ids)
                if not torch.equal(got, cpu_slots[slot_ids, :, : layout.layer_block_bytes]):
                    failures.append(f"{label}: slot bytes differ from the CPU path's")
                base = name.split("/")[0]
                if base in reference_slots and not torch.equal(got, reference_slots[base]):
                    failures.append(f"{label}: slot bytes differ from the unsplit layout's")
                reference_slots.setdefault(base, got)
            if path == "kernel" and "dma" in by_path and not torch.equal(got, by_path["dma"]):
                failures.append(f"{label}: slot bytes differ from the DMA path's")
            for t in bm:
                t[blocks] = 0
            copies.begin_step()
            copies.load(bm, layout, [b + 0 for b in blocks], slots, slot_ids)
            for i in range(len(bm)):
                copies.wait_layer(i)
            torch.cuda.current_stream().synchronize()
            for i, (t, o) in enumerate(zip(bm, original)):
                if not torch.equal(t.view(torch.int16), o.view(torch.int16)):
                    failures.append(f"{label}: layer {i} differs after a round trip")
            ok = not any(f.startswith(label + ":") for f in failures)
            tried += 1
            passed += ok
            print(f"  round trip {label:<24} kernel blocks {split}, dense {layout.dense_blocks}: "
                  f"{'ok' if ok else 'FAILED'}")
            copies.map_slots(None)
            copies.close()
        del mapped
        if pinned is not None:
            pinned.release()
        del slots
        tier.close()
    return failures, passed, tried


def bandwidth(folder: str, blocks: int) -> dict[str, float]:
    """GB/s of saves (D2H) and loads (H2D) through each copy path and a
    pinned copy_ of the same bytes, and the host milliseconds the calling
    thread spends queueing one save and one load, for an 8B-class layer
    geometry (32 layers, 16-token blocks, 8 KV heads of 128, bf16)."""
    layers, block_tokens, heads, head = 32, 16, 8, 128
    num_blocks = blocks * 2
    kv = {f"l{i}": random_bits((num_blocks, heads, block_tokens, 2 * head), torch.bfloat16, "cuda", i)
          for i in range(layers)}
    layout = KvLayout.from_kv_caches(kv, num_blocks, block_tokens=block_tokens)
    bm = [layout.block_major(kv[n]) for n in layout.layer_names]
    tier, slots, pinned, mapped = arena(layout, blocks, folder)
    ids = list(range(0, num_blocks, 2))[:blocks]
    slot_ids = list(range(blocks))
    nbytes = blocks * layers * layout.layer_block_bytes
    out: dict[str, float] = {}

    def timed(fn, name: str) -> None:
        fn()  # warm-up
        torch.cuda.synchronize()
        best = host = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            queued = fn()
            t1 = time.perf_counter()
            if isinstance(queued, torch.cuda.Event):
                queued.synchronize()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            host = min(host, t1 - t0)
        out[name] = nbytes / best / 1e9
        out[name + "_ms"] = best * 1e3
        out[name + "_host_ms"] = host * 1e3

    for path in ("dma", "kernel"):
        if path == "kernel" and mapped is None:
            continue
        copies = StreamCopies(torch.device("cuda"))
        if path == "kernel":
            copies.map_slots(slots, mapped)

        def save():
            for i, t in enumerate(bm):
                copies.save_layer(i, t, layout, ids, slots, slot_ids)
            return copies.end_saves()

        def load():
            done = copies.load(bm, layout, ids, slots, slot_ids)
            copies.wait_loads()
            return done

        # (Measured as it is, also for fewer blocks than copy.KERNEL_MIN_BLOCKS.)
        floor, copy_module.KERNEL_MIN_BLOCKS = copy_module.KERNEL_MIN_BLOCKS, 1 if path == "kernel" else 1 << 30
        try:
            timed(save, f"{path}_d2h")
            timed(load, f"{path}_h2d")
        finally:
            copy_module.KERNEL_MIN_BLOCKS = floor
        copies.map_slots(None)
        copies.close()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    timed(lambda: host.copy_(dev, non_blocking=True), "base_d2h")
    timed(lambda: dev.copy_(host, non_blocking=True), "base_h2d")
    mapped = None
    if pinned is not None:
        pinned.release()
    tier.close()
    return out


def large_arena(folder: str, gib: int) -> str:
    """Blocks at both ends of a ``gib`` GiB arena, registered in parts of
    8 GiB, through the kernel path: a slot matrix whose offsets pass 2**31
    elements (64-bit index arithmetic in the kernels) and a mapping made of
    several registrations. '' when every round trip is bit-exact, else why not."""
    layers, block_tokens, heads, head, num_blocks = 32, 16, 8, 128, 8
    kv = {f"l{i}": random_bits((num_blocks, heads, block_tokens, 2 * head), torch.bfloat16, "cuda", 50 + i)
          for i in range(layers)}
    layout = KvLayout.from_kv_caches(kv, num_blocks, block_tokens=block_tokens)
    bm = [layout.block_major(kv[n]) for n in layout.layer_names]
    original = [t.clone() for t in bm]
    path = os.path.join(folder, f"kvtier-gpu-check-{uuid.uuid4().hex}")
    tier = DramTier.create(path, gib << 30, layout.block_bytes)
    try:
        pinned, why = pin_host_memory(tier._slots.data_ptr(), tier._slots.numel(), chunk_bytes=8 << 30,
                                      unit=tier.slot_stride)
        if pinned is None:
            return f"large arena: not pinned ({why})"
        try:
            ok, why = mapped_at_host_address(pinned)
            if not ok:
                return f"large arena: not mapped ({why})"
            slots = slot_matrix(tier._slots[:, : tier.rank_bytes], layout)
            copies = StreamCopies(torch.device("cuda"))
            copies.map_slots(slots, device_slot_view(slots, torch.device("cuda")))
            n = slots.shape[0]
            slot_ids, blocks = [0, 1, n // 2, n - 2, n - 1], [4, 0, 7, 2, 5]
            for i, t in enumerate(bm):
                copies.save_layer(i, t, layout, blocks, slots, slot_ids)
            copies.end_saves().synchronize()
            for b, s in zip(blocks, slot_ids):
                for i, t in enumerate(bm):
                    want = t[b].cpu().view(torch.uint8).reshape(-1)
                    if not torch.equal(slots[s, i, : layout.layer_block_bytes], want):
                        return f"large arena: slot {s} of {n} layer {i} differs from block {b}"
            for t in bm:
                t.zero_()
            copies.load(bm, layout, [1, 2, 3, 6, 7], slots, slot_ids)
            copies.wait_loads()
            torch.cuda.synchronize()
            for i, (t, o) in enumerate(zip(bm, original)):
                if not torch.equal(t[[1, 2, 3, 6, 7]].view(torch.int16), o[blocks].view(torch.int16)):
                    return f"large arena: layer {i} differs after the round trip"
            copies.map_slots(None)
            copies.close()
            print(f"  large arena {gib} GiB ({n} slots, {len(pinned.parts)} registrations): round trip at both ends ok")
            return ""
        finally:
            pinned.release()
    finally:
        tier.close()


def e2e() -> str:
    """A DRAM hit on the GPU gives the device hit's greedy output; '' when it does, else why not."""
    from kvtier.tools.model import build_model
    from kvtier.tools.server import ServerOptions, VllmServer
    import httpx
    import random

    model = str(build_model("tiny"))
    rng = random.Random(1)
    prompt = [rng.randrange(16, 900) for _ in range(24 * 64)]
    opts = ServerOptions(model=model, kvtier={"dram_size": "1GB"}, block_size=64, num_gpu_blocks=40,
                         max_num_batched_tokens=512, dtype="float32", memory_fraction=0.5)
    with VllmServer(opts, log_path="gpu-check-vllm.log") as srv:
        def complete(p: list[int]) -> str:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "model", "prompt": p, "max_tokens": 16,
                                                              "temperature": 0.0}, timeout=600)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        complete(prompt)
        device_hit = complete(prompt)
        for seed in range(3):  # 4,500 tokens: more than the 2,560 the device cache holds
            complete([random.Random(100 + seed).randrange(16, 900) for _ in range(1500)])
        before = srv.metrics()
        again = complete(prompt)
        after = srv.metrics()
    loaded = after.get("kvtier_blocks_loaded_total", 0) - before.get("kvtier_blocks_loaded_total", 0)
    errors = after.get("kvtier_load_errors_total", 0) - before.get("kvtier_load_errors_total", 0)
    if loaded < 23 or errors:
        return f"e2e: {loaded:.0f} blocks loaded, {errors:.0f} load errors (log: gpu-check-vllm.log)"
    if again != device_hit:
        return f"e2e: DRAM hit answered {again!r}, device hit {device_hit!r}"
    return ""


def run_tests(here: str) -> str:
    """tests/cuda under pytest (when pytest is there): '' when they pass, else why not."""
    import subprocess

    try:
        import pytest  # noqa: F401
    except ImportError:
        return "tests/cuda not run: no pytest"
    env = dict(os.environ, PYTHONPATH=os.path.join(here, "src") + os.pathsep + here)
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          os.path.join(here, "tests", "cuda")], cwd=here, env=env)
    return "" if rc == 0 else f"tests/cuda failed (pytest exit {rc})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks per bandwidth run (2 MiB each)")
    ap.add_argument("--e2e", action="store_true", help="also serve a test model with vLLM (CUDA build) and kvtier")
    ap.add_argument("--no-tests", action="store_true", help="skip tests/cuda")
    ap.add_argument("--large-arena", type=int, default=0, metavar="GIB",
                    help="also round-trip blocks at both ends of an arena of GIB GiB (24 or more passes 2**31 "
                         "elements; needs that much free memory in --shm-dir)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: FAIL no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
        return 2
    print(f"torch {torch.__version__} CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}")
    folder = args.shm_dir if os.path.isdir(args.shm_dir) else tempfile.gettempdir()
    failures, passed, tried = round_trips(folder)
    for n in (1, 16, 128):  # a decode step's save, a short prompt's, a 2k-token prompt's
        small = bandwidth(folder, n)
        line = []
        for path in ("dma", "kernel"):
            if f"{path}_d2h" in small:
                line.append(f"{path} save {small[f'{path}_d2h_ms']:.2f} ms (host {small[f'{path}_d2h_host_ms']:.2f}), "
                            f"load {small[f'{path}_h2d_ms']:.2f} ms (host {small[f'{path}_h2d_host_ms']:.2f})")
        print(f"  {n:>3} blocks x 32 layers: " + "; ".join(line))
    bw = bandwidth(folder, args.blocks)
    summary = []
    for path in ("dma", "kernel"):
        if f"{path}_d2h" not in bw:
            continue
        for way in ("d2h", "h2d"):
            got, base = bw[f"{path}_{way}"], bw[f"base_{way}"]
            print(f"  {way.upper()} {path:<6} {got:6.1f} GB/s, pinned copy_ {base:6.1f} GB/s ({got / base:.2f}x); "
                  f"host thread {bw[f'{path}_{way}_host_ms']:.2f} ms for {args.blocks} blocks x 32 layers")
            summary.append(f"{way.upper()} {path} {got:.1f} GB/s = {got / base:.2f}x")
    notes = []
    if args.large_arena:
        why = large_arena(folder, args.large_arena)
        notes.append(why or f"large arena {args.large_arena} GiB ok")
        if why:
            failures.append(why)
    if not args.no_tests:
        why = run_tests(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        notes.append(why or "tests/cuda passed")
        if why and not why.endswith("no pytest"):
            failures.append(why)
    e2e_note = "e2e not run"
    if args.e2e:
        why = e2e()
        e2e_note = "e2e DRAM hit identical" if not why else why
        if why:
            failures.append(why)
    verdict = "PASS" if not failures else "FAIL"
    print(f"gpu_check: {verdict} round trips {passed}/{tried} layout x path runs bit-exact; " + "; ".join(summary)
          + f"; {'; '.join(notes + [e2e_note])}" + ("" if not failures else " | " + "; ".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
