"""Worker half of the connector: copies blocks between vLLM's KV and the arena.

Runs in each vLLM worker process (one per rank). Per engine step:

1. ``start_load_kv`` (before the forward pass): for each planned load,
   check the slot header (key, every rank sealed) and copy the slot into
   vLLM's block; start verifying the copied slots' checksums in a thread;
2. ``wait_for_save`` (after the forward pass): copy each newly full block
   into its slot and seal it with its checksum;
3. ``get_block_ids_with_load_errors``: join the verification; every block
   whose header or checksum failed is reported, and vLLM discards what the
   step computed from it and recomputes the block;
4. ``build_connector_worker_meta``: report the step as done, with the save
   slots that failed and the keys found corrupt.

Copies are synchronous: on the CPU build a block copy is a memcpy far
shorter than the forward pass that produced it (docs/benchmarks.md measures
the cost), and a synchronous save cannot race vLLM freeing the block.
Errors never escape into vLLM: they become misses.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor


import torch

from kvtier.connector.copy import gather_blocks, scatter_blocks, slot_matrix
from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.stats import KvtierStats
from kvtier.layout import KvLayout, LayoutKind, block_major
from kvtier.tier.dram import DramTier, checksum

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, rank: int, num_blocks: int, verify_checksums: bool = True,
                 kind: LayoutKind | None = None) -> None:
        self.rank = rank
        self.num_blocks = num_blocks
        self.verify_checksums = verify_checksums
        self._kind = kind
        self.layout: KvLayout | None = None
        self._layers: list[torch.Tensor] = []
        self._tier: DramTier | None = None
        self._slots: torch.Tensor | None = None
        self._load_errors: set[int] = set()
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
        self.layout = KvLayout.from_kv_caches(kv_caches, self.num_blocks, self._kind)
        self._layers = [block_major(kv_caches[n], self.layout.kind) for n in self.layout.layer_names]
        log.info("kvtier: %d layers, %s layout, %d bytes per block per layer",
                 len(self._layers), self.layout.kind.value, self.layout.layer_block_bytes)

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
        if self._tier is not None:
            self._tier.close()
        self._tier = tier
        region = tier._slots[:, self.rank * tier.rank_stride : self.rank * tier.rank_stride + tier.rank_bytes]
        self._slots = slot_matrix(region, self.layout)
        return True

    # --- loads ------------------------------------------------------------

    def start_load_kv(self, plan: StepPlan) -> None:
        self._report = StepReport(done={plan.step: 1}) if (plan.loads or plan.saves) else None
        self._last_report = None
        self._step_load_failed = False
        if not plan.loads:
            return
        if not self._attach(plan.arena):
            self._load_errors.update(c.block_id for c in plan.loads)
            return
        t0 = time.perf_counter()
        tier = self._tier
        good: list[BlockCopy] = []
        for c in plan.loads:
            # The header check is cheap and comes first: a slot that does not
            # hold this key, sealed by every rank, is never copied.
            if c.slot >= 0 and tier.is_sealed(c.slot, c.key):
                good.append(c)
                continue
            self._load_errors.add(c.block_id)
            if c.slot >= 0 and self._report is not None:
                # Published but not sealed for this key: the index must forget it.
                self._report.corrupt_keys.append(c.key)
        try:
            scatter_blocks(self._layers, self.layout, [c.block_id for c in good], self._slots,
                           [c.slot for c in good])
        except Exception:  # noqa: BLE001
            log.exception("kvtier: loading %d blocks failed; vLLM recomputes them", len(good))
            self._load_errors.update(c.block_id for c in good)
            good = []
        if good and self.verify_checksums:
            # Checksums are verified while the forward pass runs (xxhash
            # releases the GIL) and joined before vLLM asks for load errors at
            # the end of this step: a block that fails is reported then, vLLM
            # drops the token this step sampled and recomputes the block, so
            # nothing computed from it is ever served. Verifying before the
            # copy put the whole pass on the critical path (docs/benchmarks.md).
            self._verifying = self._verifier().submit(self._verify, good)
            self._verifying_copies = good
        self._stats.add("blocks_loaded", len(good))
        self._stats.add("bytes_loaded", len(good) * self.layout.block_bytes)
        self._stats.add("load_seconds", time.perf_counter() - t0)

    def _verifier(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify")
        return self._pool

    def _verify(self, copies: list[BlockCopy]) -> list[BlockCopy]:
        bad = []
        for c in copies:
            try:
                ok = self._tier.verify(c.slot, c.key, self.rank, check_data=True)
            except Exception:  # noqa: BLE001 - anything wrong is a miss
                log.exception("kvtier: verifying slot %d failed", c.slot)
                ok = False
            if not ok:
                bad.append(c)
        return bad

    def _join_verification(self) -> None:
        fut, self._verifying = self._verifying, None
        if fut is None:
            return
        copies = self._verifying_copies
        self._verifying_copies = []
        try:
            bad = fut.result()
        except Exception:  # noqa: BLE001 - unverified loads are not good loads
            log.exception("kvtier: checksum verification failed to run; the loads are reported as errors")
            self._load_errors.update(c.block_id for c in copies)
            self._step_load_failed = True
            return
        if bad:
            log.warning("kvtier: %d loaded blocks failed their checksum; vLLM recomputes them", len(bad))
            self._load_errors.update(c.block_id for c in bad)
            self._stats.add("blocks_loaded", -len(bad))
            self._stats.add("bytes_loaded", -len(bad) * self.layout.block_bytes)
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
        self._join_verification()
        if self._load_errors:
            self._step_load_failed = True
            self._stats.add("load_errors", len(self._load_errors))
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves ------------------------------------------------------------

    def wait_for_save(self, plan: StepPlan) -> None:
        if not plan.saves:
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
        t0 = time.perf_counter()
        blocks = [c.block_id for c in plan.saves]
        slots = [c.slot for c in plan.saves]
        try:
            gather_blocks(self._layers, self.layout, blocks, self._slots, slots)
            for c in plan.saves:
                self._tier.seal(c.slot, c.key, self.rank, checksum(self._tier.rank_view(c.slot, self.rank), c.key))
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("kvtier: saving %d blocks failed", len(blocks))
            report.failed_slots.extend(slots)
            self._stats.add("save_errors", len(blocks))
            return
        self._stats.add("blocks_saved", len(blocks))
        self._stats.add("bytes_saved", len(blocks) * self.layout.block_bytes)
        self._stats.add("save_seconds", time.perf_counter() - t0)

    def build_report(self) -> StepReport | None:
        self._join_verification()  # normally joined already, with the load errors
        report, self._report = self._report, None
        self._last_report = report
        return report

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
        self._join_verification()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._slots = None
        if self._tier is not None:
            self._tier.close()
            self._tier = None


