"""Worker half of the connector: copies blocks between vLLM's KV and the arena.

Runs in each vLLM worker process (one per rank). Per engine step:

1. ``start_load_kv`` (before the forward pass): for each planned load,
   check the slot header (key, every rank sealed) and copy the slot into
   vLLM's block; on CPU each block's checksum is checked right after its
   copy, from the cache; device copies are verified in a thread while the
   forward pass runs;
2. ``wait_for_save`` (after the forward pass): copy each newly full block
   into its slot and seal it with its checksum (on CPU block by block, the
   checksum right after the copy);
3. ``get_block_ids_with_load_errors``: join the verification; every block
   whose header or checksum failed is reported, and vLLM discards what the
   step computed from it and recomputes the block;
4. ``build_connector_worker_meta``: report the step as done, with the save
   slots that failed and the keys found corrupt.

On CPU, copies are synchronous: a block copy is a memcpy far shorter than
the forward pass that produced it (docs/benchmarks.md measures the cost),
and a synchronous save cannot race vLLM freeing the block. With
``defer_saves``, a step's saves are held and copied at the start of the
next step (``copy_deferred_saves``, from vLLM's ``handle_preemptions``,
which comes before vLLM zeroes, copies or writes any KV in that step), so
that the step's tokens go out first; the step's report, and the frees the
scheduler delayed, wait for them, as for device copies below. A thread reads
a byte of each page of vLLM's KV cache every ``kv_warm_interval_s``
(hostmem.PageWarmer): on a host that takes back memory a guest leaves
untouched, loads would otherwise write into cold pages at a tenth of
memory speed.

On a CUDA device, copies run on a stream of the worker's own
(copy.StreamCopies), between vLLM's blocks and the arena registered as
page-locked memory (hostmem.pin_host_memory; pageable if that fails, said
once in the log):

* loads are queued in ``start_load_kv`` layer by layer, each layer with an
  event that ``wait_for_layer_load`` makes vLLM's stream wait for;
* saves are queued in ``save_kv_layer`` as each layer's attention has
  written its KV (layers vLLM did not announce are queued in
  ``wait_for_save``); ``wait_for_save`` records an event and does not wait
  for it, and makes vLLM's stream wait for the copies before anything it
  queues next (the next step's block zeroing and KV writes): a block freed
  by vLLM (preemption frees without asking) is never overwritten while a
  save still reads it, and the host never waits;
* a step's slots are sealed once its event has completed (polled at the
  next hook), and the step's report is held back until then: reports go
  out in step order, since the store settles every step up to the one
  reported;
* requests whose free the scheduler delayed (``request_finished``, listed
  in a later plan's ``delayed``) are reported by ``get_finished`` once
  every step up to their last save has been settled.

If vLLM's KV tensors have a shape kvtier cannot read (layout.py), the
worker stays inert: one error line, every planned load a load error,
every save a failed slot; the engine serves without the cache.
Errors never escape into vLLM: they become misses.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.copy import (
    KERNEL_COPIES,
    StreamCopies,
    can_check_while_copying,
    device_slot_view,
    gather_blocks,
    gather_sealed,
    scatter_blocks,
    scatter_checked,
    slot_matrix,
    written_runs,
)
from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.stats import KvtierStats
from kvtier.hostmem import (
    PageWarmer,
    PinnedRegion,
    mapped_at_host_address,
    pin_host_memory,
    streaming_copies_line,
)
from kvtier.layout import KvLayout, LayoutKind
from kvtier.tier.dram import DramTier, checksum, checksum_runs

log = logging.getLogger(__name__)


class _Deferred:
    """A held step's saves waiting for the next step's start (``defer_saves``)."""

    @staticmethod
    def query() -> bool:
        return False


DEFERRED = _Deferred()


@dataclass
class _HeldStep:
    """A step whose report waits for its saves' copies (device copies only)."""

    step: int
    report: StepReport | None = None  # None until vLLM took the step's report
    saves: list[BlockCopy] = field(default_factory=list)
    done: Any = None  # an event with query(); None: nothing queued
    failed: bool = False  # the saves must not be published
    failed_slots: list[int] = field(default_factory=list)  # settled as failed, for the report
    registered: bool = False  # wait_for_save ran for this step
    arena: str = ""  # the arena its saves were copied into (sealed only there)
    started_s: float = 0.0


class WorkerSide:
    def __init__(self, rank: int, num_blocks: int, verify_checksums: bool = True,
                 kind: LayoutKind | None = None, block_tokens: int | None = None,
                 saves_per_layer: bool = True, warm_interval_s: float = 0.0, defer_saves: bool = False) -> None:
        self.rank = rank
        # CPU: a step's saves copied at the start of the next step
        # (copy_deferred_saves, from vLLM's handle_preemptions) rather than
        # at its end, so that the step's tokens go out first.
        self.defer_saves = defer_saves
        self.warm_interval_s = warm_interval_s
        self._warmer: PageWarmer | None = None  # keeps a KV cache in host memory warm for loads
        # Device copies: queue a layer's saves as vLLM announces the layer
        # written (save_kv_layer). Not with microbatches: the first one's
        # call comes before the second has written the layer.
        self.saves_per_layer = saves_per_layer
        self._loaded_step = -1  # the last step whose loads were queued on the device
        self.step_load_block_ids: list[int] = []  # the blocks the current step loads into
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.verify_checksums = verify_checksums
        self._kind = kind
        self.layout: KvLayout | None = None
        self.inert_reason = ""  # why this worker copies nothing ("" when it works)
        self._copies: StreamCopies | None = None  # device copies; None on CPU
        self._pinned: PinnedRegion | None = None
        self._pinning: threading.Thread | None = None  # registering the arena as page-locked
        self._layer_index: dict[str, int] = {}
        self._saved_layers: set[int] = set()  # layers whose saves of step _saved_step are queued
        self._saved_step = -1
        self._held: list[_HeldStep] = []  # steps not yet reported, in order (device copies, deferred saves)
        self._delayed: dict[str, int] = {}  # request -> last step with its saves (frees delayed)
        self._last_step = -1
        self._layers: list[torch.Tensor] = []
        self._tier: DramTier | None = None
        self._slots: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        self._errors_again: set[int] = set()  # the last step's load errors, reported with this step too
        self._report: StepReport | None = None
        self._stats = KvtierStats()
        self._bad_arena = ""  # the last arena that could not be mapped (not tried again)
        self._pool: ThreadPoolExecutor | None = None
        self._verifying: Future | None = None
        self._verifying_copies: list[BlockCopy] = []
        # The step's report stays reachable after vLLM took it: with
        # speculative decoding vLLM calls wait_for_save after
        # build_connector_worker_meta, and save failures must still reach it.
        self._last_report: StepReport | None = None
        self._step_load_failed = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read the layout of vLLM's KV tensors; a layout kvtier cannot read
        leaves the worker inert (one error line) instead of failing start-up."""
        if self._warmer is not None:  # registered again: the old tensors are let go
            self._warmer.close()
            self._warmer = None
        self._close_arena()  # (registered again: the old copies end before their stream is replaced)
        try:
            layout = KvLayout.from_kv_caches(kv_caches, self.num_blocks, self._kind, self.block_tokens)
        except ValueError as err:
            self.inert_reason = str(err)
            log.error("kvtier: off on worker rank %d: %s; every load is recomputed and nothing is saved",
                      self.rank, err)
            return
        self.layout = layout
        self._layers = [layout.block_major(kv_caches[n]) for n in layout.layer_names]
        self._layer_index = {n: i for i, n in enumerate(layout.layer_names)}
        device = self._layers[0].device
        if device.type == "cuda":
            self._copies = StreamCopies(device)
        elif device.type == "cpu":
            if self.warm_interval_s > 0:
                self._warm(list(kv_caches.values()))
            if self.rank == 0 and can_check_while_copying(self._layers, layout):  # copies by memmove
                log.info("kvtier: %s", streaming_copies_line(layout.layer_block_bytes)[1])
        log.info("kvtier: %d layers, %s layout%s, %d bytes per block per layer, %s copies",
                 len(self._layers), layout.kind.value,
                 f" ({layout.kernel_blocks} kernel blocks per block)" if layout.kernel_blocks > 1 else "",
                 layout.layer_block_bytes, "asynchronous device" if self._copies else "synchronous")
        if self.defer_saves and self._copies is None:
            log.info("kvtier: a step's saves are copied at the next step's start (defer_saves)")

    def _warm(self, tensors: list[torch.Tensor]) -> None:
        """Keep the pages of vLLM's KV tensors (each storage once) warm
        for the loads that write into them (:class:`PageWarmer`); a
        failure leaves them as they are (one line), the worker working."""
        try:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            self._warmer = PageWarmer(sorted(storages.items()), self.warm_interval_s, keep=tensors,
                                      name=f"kvtier-warm-{self.rank}").start()
        except Exception as err:  # noqa: BLE001 - an optimisation; the copies do not depend on it
            log.warning("kvtier: the KV cache is not kept warm (kv_warm_interval_s): %s", err)
            return
        log.info("kvtier: reading a byte of each page of the KV cache (%d MiB) every %g s, so that loads do "
                 "not write into memory the host left cold (kv_warm_interval_s)", self._warmer.bytes >> 20,
                 self.warm_interval_s)

    def _slots_in_arena(self, plan: StepPlan) -> bool:
        """Whether every save of ``plan`` names a slot of the mapped arena
        (attached first). A CPU save copies to raw addresses (memmove): a
        slot past the arena's end would be written past its mapping, and a
        device copy's negative slot would index from the end. A plan that
        names one (the placement and this worker disagree on the arena)
        fails all its step's saves; a load's slot is checked with its header."""
        n = self._tier.num_slots if self._tier is not None else 0
        out = [c.slot for c in plan.saves if not 0 <= c.slot < n]
        if out:
            log.error("kvtier: %d of the step's %d saves name slots outside the arena %s (%d slots, e.g. slot %d); "
                      "none is saved", len(out), len(plan.saves), plan.arena, n, out[0])
        return not out

    def _attach(self, path: str) -> bool:
        """Map the arena at ``path``; a plan naming another arena than the
        mapped one (a restarted meta service) maps the new one."""
        if self._tier is not None and self._tier.path == path:
            return True
        if path == self._bad_arena or self.layout is None:
            return False
        try:
            tier = DramTier.attach(path)
        except Exception as err:  # noqa: BLE001 - a missing or foreign file: this arena's copies fail
            log.error("kvtier: cannot attach DRAM arena %s (%s); its loads and saves fail", path, err)
            self._bad_arena = path
            return False
        if tier.rank_bytes < self.layout.block_bytes or self.rank >= tier.ranks:
            # Not switched off quietly: a rank that never saves looked like a
            # working cache with no hits (uneven pipeline stages, issue 7).
            # The connector checks the fit at start-up; reaching this means
            # the arena and this worker disagree, which no step can fix.
            from kvtier.errors import ConfigError

            tier.close()
            err = ConfigError("dram arena", path,
                              f"holds {tier.rank_bytes} bytes per block for each of {tier.ranks} ranks; "
                              f"this worker (rank {self.rank}, {len(self.layout.layer_names)} layers) needs "
                              f"{self.layout.block_bytes} bytes")
            log.error("%s", err)
            raise err
        self._close_arena()
        self._tier = tier
        region = tier._slots[:, self.rank * tier.rank_stride : self.rank * tier.rank_stride + tier.rank_bytes]
        self._slots = slot_matrix(region, self.layout)
        if self._copies is not None:
            self._pin(tier, self._slots)
        return True

    def _pin(self, tier: DramTier, slots: torch.Tensor) -> None:
        """Register the arena as page-locked on a thread of its own: about 0.1 s
        a GB (a 160 GB node pool: 16 s), which on vLLM's thread would hold
        up the step that first maps the arena. Copies meanwhile go through
        pageable memory (correct, slower); a refusal's pending CUDA error
        stays on that thread, never on vLLM's. Once registered, and mapped
        into the device's address space at the same addresses, the copies
        of ``slots`` (this rank's slot matrix) become one kernel a layer
        (copy.device_slot_view); else one DMA a block and layer."""
        data = tier._slots
        device = self._layers[0].device if self._layers else None
        ptr, size, unit = data.data_ptr(), data.numel(), tier.slot_stride
        copies = self._copies

        def pin() -> None:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # else the runtime would open a context on device 0
            region, why = pin_host_memory(ptr, size, unit=unit, mapped=KERNEL_COPIES)
            if region is None:
                log.warning("kvtier: the DRAM arena %s stays pageable (%s): device copies go through the "
                            "driver's bounce buffer and block vLLM's thread", tier.path, why)
                self._pinned = region
                return
            self._pinned = region
            how = "one DMA per block and layer"
            if copies is not None and KERNEL_COPIES:
                mapped, why = mapped_at_host_address(region)
                try:
                    if mapped:
                        copies.map_slots(slots, device_slot_view(slots, device))
                        how = "one kernel per layer"
                except Exception as err:  # noqa: BLE001 - the DMA path works without it
                    why = str(err)
                if why:
                    log.warning("kvtier: device copies of the arena %s stay %s (not mapped: %s)", tier.path,
                                how, why)
            log.info("kvtier: the DRAM arena %s (%d MiB) is page-locked; device copies: %s", tier.path,
                     size >> 20, how)

        self._pinning = threading.Thread(target=pin, name="kvtier-pin", daemon=True)
        self._pinning.start()

    def _close_arena(self) -> None:
        if self._tier is None:
            return
        if self._copies is not None:
            self._copies.close()  # no copy may touch the mapping once it is gone
        if self._pinning is not None:
            self._pinning.join()  # the registration must end before the memory is unmapped
            self._pinning = None
        if self._copies is not None:
            self._copies.map_slots(None)  # (synchronized above: no kernel reads the mapping any more)
        if self._pinned is not None:
            self._pinned.release()
            self._pinned = None
        self._slots = None
        self._tier.close()
        self._tier = None

    # --- loads ------------------------------------------------------------

    def start_load_kv(self, plan: StepPlan) -> None:
        if any(h.done is DEFERRED for h in self._held):
            # vLLM did not call handle_preemptions before this step, whose
            # block zeroing may have written the blocks those saves read:
            # they are dropped, and saves are copied within their step from now on.
            log.warning("kvtier: vLLM did not call handle_preemptions; deferred saves are dropped and saves "
                        "are no longer deferred (defer_saves)")
            self.defer_saves = False
            self.fail_deferred_saves()
        self._report = StepReport(done={plan.step: 1}) if (plan.loads or plan.saves) else None
        self._last_report = None
        self._step_load_failed = False
        self.step_load_block_ids = [c.block_id for c in plan.loads]
        self._delayed.update(plan.delayed)
        if self._copies is not None:
            self._begin_device_step(plan)
        if not plan.loads:
            return
        if not self._attach(plan.arena):
            self._load_errors.update(c.block_id for c in plan.loads)
            return
        t0 = time.perf_counter()
        tier = self._tier
        good: list[BlockCopy] = []
        checked = self.verify_checksums and self._copies is None and can_check_while_copying(self._layers,
                                                                                             self.layout)
        # The header check is cheap and comes first: a slot that does not
        # hold this key, sealed by every rank and published by the index, is
        # never copied. The copies are checked against this snapshot of the
        # headers, not against the headers as they are when the check runs
        # (a slot reused meanwhile and refilled would pass a fresh read).
        slots, keys = [c.slot for c in plan.loads], [c.key for c in plan.loads]
        snapshot = None
        if self.verify_checksums:
            snapshot, sealed = tier.header_snapshot(slots, keys)
        else:
            sealed = tier.sealed_many(slots, keys, published=True)
        kept: list[int] = []
        for i, (c, ok) in enumerate(zip(plan.loads, sealed)):
            if ok:
                good.append(c)
                kept.append(i)
                continue
            self._load_errors.add(c.block_id)
            if c.slot >= 0 and self._report is not None:
                # Published for this key but not sealed by every rank: the
                # index must forget it. A slot that names another key, or is
                # no longer published, was cleared or reused since the plan
                # (a pin that outlived its lease): a miss, not a corrupt
                # block, and the key may be held elsewhere by now.
                row = snapshot[i] if snapshot is not None else tier.header_snapshot([c.slot], [c.key])[0][0]
                if bytes(row["key"]) == c.key and row["published"]:
                    self._report.corrupt_keys.append(c.key)
        headers = snapshot[kept] if snapshot is not None and good else None
        bad: list[BlockCopy] = []
        reused: list[BlockCopy] = []
        copied: Any = None  # device copies: the event after which every slot has been read
        try:
            if self._copies is not None:
                if good:
                    copied = self._copies.load(self._layers, self.layout, [c.block_id for c in good],
                                               self._slots, [c.slot for c in good])
                    self._loaded_step = plan.step
            elif checked:
                # CPU: each block's checksum right after its copy, from the
                # cache (scatter_checked); a block that fails is a load error
                # now, before the forward pass reads it.
                # The headers were checked above (the snapshot): the data
                # against the checksums the snapshot gives, hashed after each
                # block's copy (bytes that changed under it stay changed).
                matches = tier.data_checks([c.slot for c in good], [c.key for c in good], self.rank, headers)

                def check(i: int) -> bool:
                    try:
                        return matches(i)
                    except Exception:  # noqa: BLE001 - anything wrong is a miss
                        log.exception("kvtier: verifying slot %d failed", good[i].slot)
                        return False

                failed: list[int] = []
                try:
                    scatter_checked(self._layers, self.layout, [c.block_id for c in good], self._slots,
                                    [c.slot for c in good], check, failed)
                finally:
                    bad = [good[i] for i in failed]  # found bad before an exception: still reported corrupt
                if good:
                    # Cleared since the snapshot (reused, even if its header
                    # came back as it was): not what the hash checked. A
                    # block that failed its hash on a slot reused meanwhile
                    # is reused, not corrupt: its key may be held elsewhere
                    # by then, which the index must not forget.
                    unchanged = tier.headers_unchanged([c.slot for c in good], headers)
                    bad = [good[i] for i in failed if unchanged[i]]
                    reused = [c for c, same in zip(good, unchanged) if not same]
            else:
                scatter_blocks(self._layers, self.layout, [c.block_id for c in good], self._slots,
                               [c.slot for c in good])
        except Exception:  # noqa: BLE001
            log.exception("kvtier: loading %d blocks failed; vLLM recomputes them", len(good))
            self._load_errors.update(c.block_id for c in good)
            if bad and self._report is not None:
                self._report.corrupt_keys.extend(c.key for c in bad)  # the index must forget them
            good, bad, reused = [], [], []
        self._stats.add("blocks_loaded", len(good))
        self._stats.add("bytes_loaded", len(good) * self.layout.block_bytes)
        if bad:
            self._count_bad(bad)
        if reused:
            self._count_reused(reused)
        if good and self.verify_checksums and not checked:
            # Device copies (and CPU layouts memmove cannot take): checksums
            # are verified while the forward pass runs (xxhash releases the
            # GIL) and joined before vLLM asks for load errors at
            # the end of this step: a block that fails is reported then, vLLM
            # drops the token this step sampled and recomputes the block, so
            # nothing computed from it is ever served. Verifying before the
            # copy put the whole pass on the critical path (docs/benchmarks.md).
            # Once the copies have read the slots (``copied``), their bytes
            # are hashed against the snapshot's checksums and their headers
            # must still be the snapshot's: a slot whose pin was lost (session
            # ended, pin expired) and that was reused or rewritten before or
            # while the copy read it fails, instead of passing on a fresh read.
            self._verifying = self._verifier().submit(self._verify, good, headers, copied)
            self._verifying_copies = good
        self._stats.add("load_seconds", time.perf_counter() - t0)

    def _verifier(self) -> ThreadPoolExecutor:
        if self._pool is None:
            device = self._layers[0].device if self._layers else None

            def on_device() -> None:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)  # else the runtime would open a context on device 0

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify", initializer=on_device)
        return self._pool

    def _verify(self, copies: list[BlockCopy], headers: Any, copied: Any = None
                ) -> tuple[list[BlockCopy], list[BlockCopy]]:
        """(corrupt, reused) among ``copies``, once ``copied`` (an event of
        the device copies, or None: the copies are done) has completed:
        reused, a slot whose header is no longer its snapshot ``headers``
        (taken before the copies); corrupt, one whose bytes fail the
        snapshot's checksum. The bytes are hashed after the copies have read
        them: bytes that changed under a copy have not changed back. A
        failure to wait for ``copied`` raises: no copy is known good."""
        if copied is not None:
            copied.synchronize()
        tier = self._tier
        slots, keys = [c.slot for c in copies], [c.key for c in copies]
        matches = tier.data_checks(slots, keys, self.rank, headers)
        intact: list[bool] = []
        for i, c in enumerate(copies):
            try:
                intact.append(matches(i))
            except Exception:  # noqa: BLE001 - anything wrong is a miss
                log.exception("kvtier: verifying slot %d failed", c.slot)
                intact.append(False)
        unchanged = tier.headers_unchanged(slots, headers)
        reused = [c for c, same in zip(copies, unchanged) if not same]
        corrupt = [c for c, same, ok in zip(copies, unchanged, intact) if same and not ok]
        return corrupt, reused

    def _join_verification(self) -> None:
        fut, self._verifying = self._verifying, None
        if fut is None:
            return
        copies = self._verifying_copies
        self._verifying_copies = []
        try:
            corrupt, reused = fut.result()
        except Exception:  # noqa: BLE001 - unverified loads are not good loads
            # A local failure (the device copies' event, this thread): load
            # errors, but the pool's blocks are not known bad.
            log.exception("kvtier: checksum verification failed to run; the loads are reported as errors")
            self._load_errors.update(c.block_id for c in copies)
            self._uncount(len(copies))
            self._step_load_failed = True
            return
        if corrupt:
            self._count_bad(corrupt)
        if reused:
            self._count_reused(reused)

    def _uncount(self, n: int) -> None:
        self._stats.add("blocks_loaded", -n)
        self._stats.add("bytes_loaded", -n * self.layout.block_bytes)

    def _count_reused(self, reused: list[BlockCopy]) -> None:
        """Loaded slots cleared since their snapshot (a pin lost, the slot
        reused): load errors, not loads; the pool's blocks are not blamed."""
        log.warning("kvtier: %d loaded slots were reused while they were copied; vLLM recomputes them",
                    len(reused))
        self._load_errors.update(c.block_id for c in reused)
        self._uncount(len(reused))

    def _count_bad(self, bad: list[BlockCopy]) -> None:
        """Loaded blocks that failed their checksum: load errors (vLLM
        recomputes them), not loads, and keys the index must forget."""
        log.warning("kvtier: %d loaded blocks failed their checksum; vLLM recomputes them", len(bad))
        self._load_errors.update(c.block_id for c in bad)
        self._uncount(len(bad))
        if self._report is not None:
            self._report.corrupt_keys.extend(c.key for c in bad)

    def fail_loads(self, plan: StepPlan) -> None:
        """Report every load of ``plan`` as failed (after an unexpected error)."""
        self._load_errors.update(c.block_id for c in plan.loads)
        if self._report is None and (plan.loads or plan.saves):
            self._report = StepReport(done={plan.step: 1})

    def fail_saves(self, plan: StepPlan) -> None:
        self._current_report(plan.step).failed_slots.extend(c.slot for c in plan.saves)
        self._stats.add("save_errors", len(plan.saves))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks whose load failed in this step, and once more those of
        the step before.

        Under asynchronous scheduling vLLM plans step S+1 before S's errors
        reach it, and it caches a block in its prefix cache when it allocates
        it: a request planned in S+1 may have hit a block of S's failed load
        and computed on it. vLLM rolls back only the request that loaded the
        block; reported again with S+1, the block is in the computed part of
        the other request too, which vLLM then rolls back (its S+1 output
        dropped), and the scheduler half dooms the saves planned since. A
        block reported again after another request took it costs that
        request a recomputation, never wrong KV."""
        self._join_verification()
        if self._load_errors:
            self._step_load_failed = True
            self._stats.add("load_errors", len(self._load_errors))
        errors, self._load_errors = self._load_errors, set()
        again, self._errors_again = self._errors_again, errors
        return errors | again

    # --- saves ------------------------------------------------------------

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._copies is not None:
            index = self._layer_index.get(layer_name)
            if index is not None:
                self._copies.wait_layer(index)

    def save_kv_layer(self, layer_name: str, plan: StepPlan) -> None:
        """Queue the device-to-host copies of one layer's saves (device copies only)."""
        if self._copies is None or not plan.saves or not self.saves_per_layer:
            return
        index = self._layer_index.get(layer_name)
        self._saving_step(plan.step)
        if index is None or index in self._saved_layers or not self._attach(plan.arena):
            return
        held = self._held_step(plan.step)
        if held.failed:
            return
        if not self._saved_layers and not self._slots_in_arena(plan):  # once a step, at its first layer
            held.failed = True  # (counted when the step settles)
            return
        held.arena = plan.arena  # the step's slots are now being written
        self._copies.save_layer(index, self._layers[index], self.layout, [c.block_id for c in plan.saves],
                                self._slots, [c.slot for c in plan.saves])
        self._saved_layers.add(index)

    def wait_for_save(self, plan: StepPlan) -> None:
        if self._copies is not None:
            self._copies.wait_loads()
        if not plan.saves:
            return
        if self._copies is not None:
            self._queue_saves(plan)
            return
        report = self._current_report(plan.step)
        self._join_verification()  # the step's load errors must be known before anything is saved
        if self._step_load_failed or self._load_errors:
            # Blocks computed in a step where a load failed may have attended
            # to that bad block (this request's, or another's sharing it):
            # none of the step's saves may be published.
            report.failed_slots.extend(c.slot for c in plan.saves)
            return
        if not self._attach(plan.arena):
            report.failed_slots.extend(c.slot for c in plan.saves)
            return
        if not self._slots_in_arena(plan):
            report.failed_slots.extend(c.slot for c in plan.saves)
            self._stats.add("save_errors", len(plan.saves))
            return
        if self.defer_saves and report is self._report and plan.step in report.done:
            # Copied by copy_deferred_saves at the next step's start; the
            # step's report waits for it (reports go out in step order). Not
            # when vLLM took the report already (speculative decoding calls
            # wait_for_save after it): nothing would carry the saves then.
            held = self._held_step(plan.step)
            held.registered, held.saves, held.arena, held.done = True, list(plan.saves), plan.arena, DEFERRED
            return
        self._copy_and_seal(plan.saves, report.failed_slots)

    def copy_deferred_saves(self) -> None:
        """Copy and seal the saves deferred by earlier steps (``defer_saves``).
        Called before vLLM writes any KV in the new step, so their blocks
        still hold what those steps computed."""
        for held in self._held:
            if held.done is not DEFERRED:
                continue
            saves, held.saves, held.done = held.saves, [], None
            if self._tier is None or self._tier.path != held.arena:
                held.failed_slots.extend(c.slot for c in saves)  # another arena mapped since
                self._stats.add("save_errors", len(saves))
                continue
            try:
                self._copy_and_seal(saves, held.failed_slots)
            except Exception:  # noqa: BLE001 - a failed save is only a future miss, never one reported good
                log.exception("kvtier: saving %d deferred blocks failed", len(saves))
                held.failed_slots.extend(c.slot for c in saves)
                self._stats.add("save_errors", len(saves))

    def fail_deferred_saves(self) -> None:
        """Give up the deferred saves: their slots are reported failed."""
        for held in self._held:
            if held.done is DEFERRED:
                held.failed_slots.extend(c.slot for c in held.saves)
                self._stats.add("save_errors", len(held.saves))
                held.saves, held.done = [], None

    def _copy_and_seal(self, saves: list[BlockCopy], failed_slots: list[int]) -> None:
        """Copy each block of ``saves`` into its slot and seal it (CPU);
        the slots of a save that fails go to ``failed_slots``."""
        assert self._tier is not None
        t0 = time.perf_counter()
        blocks = [c.block_id for c in saves]
        slots = [c.slot for c in saves]
        tier, rank, keys = self._tier, self.rank, [c.key for c in saves]
        layers, layout = self._layers, self.layout
        runs = written_runs(layers, layout, tier.rank_bytes)

        def seal(i: int) -> None:
            # The checksum of what the copy read, not of the slot (written_runs says why).
            part = tier.rank_view(slots[i], rank)
            tier.seal(slots[i], keys[i], rank, checksum_runs(runs(blocks[i], part.data_ptr()), keys[i]))

        try:
            if can_check_while_copying(layers, layout):
                gather_sealed(layers, layout, blocks, self._slots, slots, seal)
            else:
                gather_blocks(layers, layout, blocks, self._slots, slots)
                for i in range(len(blocks)):
                    tier.seal(slots[i], keys[i], rank, checksum(tier.rank_view(slots[i], rank), keys[i]))
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("kvtier: saving %d blocks failed", len(blocks))
            failed_slots.extend(slots)
            self._stats.add("save_errors", len(blocks))
            return
        self._stats.add("blocks_saved", len(blocks))
        self._stats.add("bytes_saved", len(blocks) * self.layout.block_bytes)
        self._stats.add("save_seconds", time.perf_counter() - t0)

    def build_report(self) -> StepReport | None:
        self._join_verification()  # normally joined already, with the load errors
        report, self._report = self._report, None
        self._last_report = report
        if self._copies is None and not self._held:
            return report
        if report is not None:
            step = next(iter(report.done))
            held = next((h for h in self._held if h.step == step), None)
            if held is None:
                # No saves planned (start_load_kv holds a step that has
                # some): nothing to wait for but the steps before it.
                held = self._held_step(step)
                held.registered = True
                if step == self._loaded_step and self._copies is not None:
                    # Its loads still read their slots: the report (which
                    # lets the pool unpin them) waits for the copies.
                    held.done = self._copies.end_saves()
            held.report = report
        return self._release()

    # --- device copies: saves settled after their event -----------------------

    def _begin_device_step(self, plan: StepPlan) -> None:
        self._last_step = max(self._last_step, plan.step)
        if plan.saves:
            self._held_step(plan.step)  # its report waits for wait_for_save
        # A step whose wait_for_save never came: its copies (if any were
        # queued) finish before its slots are given back as failed.
        for held in self._held:
            if not held.registered and held.step < plan.step:
                held.registered, held.failed = True, True
                held.done = self._copies.end_saves()

    def _held_step(self, step: int) -> _HeldStep:
        for held in self._held:
            if held.step == step:
                return held
        held = _HeldStep(step, started_s=time.perf_counter())
        self._held.append(held)
        self._held.sort(key=lambda h: h.step)
        return held

    def _saving_step(self, step: int) -> None:
        # save_kv_layer runs during the forward pass, which may come before
        # start_load_kv (vLLM starts loads after the forward when a step has
        # none to wait for): the set of saved layers is kept per step.
        if step != self._saved_step:
            self._saved_step, self._saved_layers = step, set()

    def _queue_saves(self, plan: StepPlan) -> None:
        self._saving_step(plan.step)
        held = self._held_step(plan.step)
        held.saves = list(plan.saves)
        held.registered = True
        self._join_verification()  # the step's load errors must be known before anything is published
        held.failed = (held.failed or self._step_load_failed or bool(self._load_errors)
                       or not self._attach(plan.arena) or not self._slots_in_arena(plan))
        held.arena = plan.arena
        if not held.failed:
            try:
                # Layers vLLM did not announce through save_kv_layer.
                for index in range(len(self._layers)):
                    if index not in self._saved_layers:
                        self._copies.save_layer(index, self._layers[index], self.layout,
                                                [c.block_id for c in plan.saves], self._slots,
                                                [c.slot for c in plan.saves])
                        self._saved_layers.add(index)
            except Exception:  # noqa: BLE001 - a failed save is only a future miss
                log.exception("kvtier: queueing %d saves failed", len(plan.saves))
                held.failed = True
        if self._saved_layers or plan.step == self._loaded_step:
            # (A step whose loads were queued: its slots are read until the
            # event, even when none of its saves was copied.)
            held.done = self._copies.end_saves()
            # vLLM's next work (block zeroing, the next step's KV writes)
            # waits on the device for these copies, never on the host.
            self._copies.begin_step()

    def _settle(self, held: _HeldStep) -> bool:
        """Seal (or fail) a registered step's slots once its copies are done; False while they run."""
        if not held.registered:
            return False
        if held.done is not None and not held.done.query():
            return False
        held.done = None
        if not held.saves:
            return True
        if held.failed or self._tier is None or self._tier.path != held.arena:
            # (Another arena mapped since, after a restarted meta service:
            # its slots are other blocks.)
            held.failed_slots.extend(c.slot for c in held.saves)
            self._stats.add("save_errors", len(held.saves))
            held.saves = []
            return True
        try:
            for c in held.saves:
                self._tier.seal(c.slot, c.key, self.rank, checksum(self._tier.rank_view(c.slot, self.rank), c.key))
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("kvtier: sealing %d saved blocks failed", len(held.saves))
            held.failed_slots.extend(c.slot for c in held.saves)
            self._stats.add("save_errors", len(held.saves))
        else:
            self._stats.add("blocks_saved", len(held.saves))
            self._stats.add("bytes_saved", len(held.saves) * self.layout.block_bytes)
            self._stats.add("save_seconds", time.perf_counter() - held.started_s)
        held.saves = []
        return True

    def _release(self) -> StepReport | None:
        """Reports of the leading steps whose saves are settled and whose
        report vLLM has handed over, merged; None if there are none."""
        out: StepReport | None = None
        while self._held and self._held[0].report is not None and self._settle(self._held[0]):
            held = self._held.pop(0)
            report = held.report
            report.failed_slots.extend(held.failed_slots)
            out = report if out is None else out.aggregate(report)
        return out

    def release_delayed(self) -> set[str]:
        done, self._delayed = set(self._delayed), {}
        return done

    def get_finished(self) -> set[str] | None:
        """Requests whose delayed free may go ahead: every step up to their last save is settled."""
        if not self._delayed:
            return None
        for held in self._held:
            if not self._settle(held):
                break
        pending = [h.step for h in self._held if h.saves or h.done is not None or not h.registered]
        settled_through = (min(pending) - 1) if pending else max(self._last_step, max(self._delayed.values()))
        done = {r for r, step in self._delayed.items() if step <= settled_through}
        for r in done:
            del self._delayed[r]
        return done or None

    def _current_report(self, step: int) -> StepReport:
        report = self._report or self._last_report
        if report is None:
            report = self._report = StepReport(done={step: 1})
        return report

    def get_kv_connector_stats(self) -> KvtierStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvtierStats()
        return stats

    def shutdown(self) -> None:
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None
        self._join_verification()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._close_arena()


