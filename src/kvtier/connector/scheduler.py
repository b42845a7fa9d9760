"""Scheduler half of the connector: lookups, load plans, save plans.

Runs in vLLM's engine-core process, on the scheduler's thread. Per engine
step vLLM calls, in this order:

1. ``get_num_new_matched_tokens`` for each waiting request (may repeat):
   the longest pool-held prefix of full blocks beyond vLLM's own hit, never
   the whole prompt;
2. ``update_state_after_alloc`` once blocks are allocated: pin the slots to
   load from;
3. ``build_connector_meta``: the :class:`StepPlan` (loads, and saves of
   every block that became full this step and is not in the pool yet);
4. later, ``update_connector_output`` with the workers' :class:`StepReport`:
   saved entries become readable, pins of the step are released.

Keys of a request are computed once and extended as its tokens grow.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.stats import KvtierStats
from kvtier.keys import KeyNamespace, block_keys
from kvtier.store import TieredStore

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _ReqState:
    request: Any
    keys: list[bytes] = field(default_factory=list)
    saved_blocks: int = 0  # blocks [0, saved_blocks) are saved or were planned
    device_tokens: int = 0  # vLLM's own hit, from the last lookup
    hit_blocks: int = 0  # pool-held leading blocks, from the last lookup
    load: list[tuple[int, int, bytes]] = field(default_factory=list)  # (block_id, slot, key)


class SchedulerSide:
    def __init__(self, store: TieredStore, namespace: KeyNamespace, block_tokens: int, ranks: int,
                 kv_cache_manager: Any = None) -> None:
        self.store = store
        self.block_tokens = block_tokens
        self.ranks = ranks
        self._seed = namespace.seed()
        self._reqs: dict[str, _ReqState] = {}
        self._step = 0
        self._loads_this_step: list[BlockCopy] = []
        self.kv_cache_manager = kv_cache_manager
        self._stats = KvtierStats()
        self._last_evictions = 0
        self._last_used = -1

    # --- keys -------------------------------------------------------------

    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request)
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _ReqState, num_tokens: int) -> list[bytes]:
        """Keys of the full blocks among the request's first ``num_tokens`` tokens."""
        want = num_tokens // self.block_tokens
        have = len(st.keys)
        if want > have:
            tokens = st.request.all_token_ids
            want = min(want, len(tokens) // self.block_tokens)
            if want > have:
                end = want * self.block_tokens
                st.keys.extend(block_keys(self._seed, tokens[have * self.block_tokens : end], self.block_tokens)
                               if have == 0 else
                               block_keys(self._seed, tokens[:end], self.block_tokens, start=have,
                                          parent=st.keys[-1]))
        return st.keys[:want]

    # --- vLLM hooks -------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Hash the prompt's blocks when the request arrives, not while it waits to be scheduled."""
        self._keys(self._state(request), request.num_tokens - 1)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        # At least one token must be computed to produce logits.
        limit = request.num_tokens - 1
        keys = self._keys(st, limit)
        hit = self.store.lookup(keys)
        st.hit_blocks = hit
        st.device_tokens = num_computed_tokens
        ext = hit * self.block_tokens - num_computed_tokens
        if ext <= 0 or num_computed_tokens % self.block_tokens:
            return 0, False
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        first = st.device_tokens // self.block_tokens
        last = (st.device_tokens + num_external_tokens) // self.block_tokens
        block_ids = blocks.get_block_ids()[0]
        keys = st.keys[first:last]
        slots = self.store.pin(keys, self._step)
        for i, (key, slot) in enumerate(zip(keys, slots)):
            # A slot that vanished since the lookup is planned with slot -1:
            # the worker reports the block as a load error and vLLM recomputes.
            self._loads_this_step.append(BlockCopy(block_ids[first + i], -1 if slot is None else slot, key))
        # Blocks loaded from the pool are already there; never save them again.
        st.saved_blocks = max(st.saved_blocks, last)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        step = self._step
        plan = StepPlan(step=step, arena=self.store.tier.path, loads=self._loads_this_step)
        self._loads_this_step = []
        sched = scheduler_output.num_scheduled_tokens
        for req_id, n_sched in sched.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            req = st.request
            done_tokens = min(req.num_computed_tokens + n_sched, len(req.all_token_ids))
            n_full = done_tokens // self.block_tokens
            if n_full <= st.saved_blocks:
                continue
            keys = self._keys(st, n_full * self.block_tokens)
            n_full = len(keys)
            block_ids = self.kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            first = st.saved_blocks
            new_keys = keys[first:n_full]
            slots = self.store.prepare_save(new_keys, step)
            for i, slot in enumerate(slots):
                if slot is not None:
                    plan.saves.append(BlockCopy(block_ids[first + i], slot, new_keys[i]))
            st.saved_blocks = n_full
        self._step += 1
        return plan

    def update_connector_output(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, StepReport):
            return
        if report.corrupt_keys:
            self.store.discard(report.corrupt_keys)
            self._stats.add("corrupt_blocks", len(report.corrupt_keys))
        for step, n in sorted(report.done.items()):
            failed = report.failed_slots if n >= self.ranks else None
            if failed is None:
                # Not every rank finished: nothing of that step may be read.
                log.warning("kvtier: step %d reported by %d of %d ranks; dropping its saves", step, n, self.ranks)
                self.store.complete_step(step, failed_slots=range(self.store.tier.num_slots))
            else:
                self.store.complete_step(step, failed_slots=failed)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def get_kv_connector_stats(self) -> KvtierStats | None:
        stats = self._stats
        evictions = self.store.evictions
        used = self.store.used_slots
        if evictions > self._last_evictions:
            stats.add("evictions", evictions - self._last_evictions)
            self._last_evictions = evictions
        if stats.is_empty() and used == self._last_used:
            return None
        self._stats = KvtierStats()
        self._last_used = used
        stats.data["dram_slots_used"] = used
        stats.data["dram_slots_total"] = self.store.tier.num_slots
        return stats

    def shutdown(self) -> None:
        self.store.tier.close()


def arena_path(shm_dir: str, engine_id: str) -> str:
    return os.path.join(shm_dir, f"kvtier-dram-{os.getpid()}-{engine_id}")


def remove_stale_arenas(shm_dir: str) -> list[str]:
    """Remove arenas left by processes that no longer exist (killed engines)."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith("kvtier-dram-"):
            continue
        try:
            pid = int(name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
        except PermissionError:
            pass
    return removed
