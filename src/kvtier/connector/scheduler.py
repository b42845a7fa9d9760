"""Scheduler half of the connector: lookups, load plans, save plans.

Runs in vLLM's engine-core process, on the scheduler's thread. Per engine
step vLLM calls, in this order:

1. ``get_num_new_matched_tokens`` for each waiting request (may repeat):
   the longest pool-held prefix of full blocks beyond vLLM's own hit, never
   the whole prompt;
2. ``update_state_after_alloc`` once blocks are allocated: pin the slots to
   load from;
3. ``build_connector_meta``: the :class:`StepPlan` (loads, and saves of
   every block that became full this step and is not in the pool yet; one
   that found no room is planned again in a later step);
4. later, ``update_connector_output`` with the workers' :class:`StepReport`:
   saved entries become readable, pins of the step are released.

Keys of a request are computed once and extended as its tokens grow.
``reset_cache`` (vLLM's reset after a weight update) gives keys a new seed
and forgets every request's state, so nothing from before it matches after.
While a lookup waits for a promotion from SSD, the scheduler thread yields
to the I/O threads at most once per pass (``build_connector_meta`` ends one).
"""

from __future__ import annotations

import json
import logging
import os
import time

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.stats import GAUGES, KvtierStats
from kvtier.keys import KEY_BYTES, KeyNamespace, KeyRun, block_keys, digest16
from kvtier.placement import EmbeddedPlacement, Placement
from kvtier.store import TieredStore

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# How many planned steps' loads are remembered for a failure report: one
# comes a step or two after its plan (a few more with pipeline stages).
AFTER_LOAD_STEPS = 16


@dataclass
class _ReqState:
    request: Any
    keys: list[bytes] = field(default_factory=list)
    packed: bytearray = field(default_factory=bytearray)  # the same keys back to back (KeyRun.packed)
    saved_blocks: int = 0  # blocks [0, saved_blocks) are saved or were planned
    device_tokens: int = 0  # vLLM's own hit, from the last lookup
    hit_blocks: int = 0  # pool-held leading blocks, from the last lookup
    disk_keys: set[bytes] = field(default_factory=set)  # keys this request had promoted from SSD
    p2p_keys: set[bytes] = field(default_factory=set)  # keys this request had fetched from the cluster tier
    load_keys: list[bytes] = field(default_factory=list)  # keys of the last planned load
    waiting_since: float | None = None  # waiting for a promotion since (monotonic)
    last_save_step: int = -1  # the last step that planned a save of this request's blocks
    seed: bytes = b""  # the chain's seed: the namespace, plus the request's LoRA and cache salt
    uncacheable: bool = False  # multimodal or embedding inputs: tokens alone do not name the KV
    planned_tokens: int | None = None  # its computed tokens once its last planned step is computed


def _run(st: _ReqState, first: int, last: int) -> KeyRun:
    """Keys ``first`` to ``last`` of a request, the list and the buffer, each
    copied once (a copy of 64 KiB costs a tenth of joining 4,096 keys; the
    request's own buffer grows in place as its keys are made)."""
    if first == 0 and last >= len(st.keys):
        return KeyRun(st.keys, bytes(st.packed))
    return KeyRun(st.keys[first:last], bytes(memoryview(st.packed)[first * KEY_BYTES : last * KEY_BYTES]))


class SchedulerSide:
    def __init__(self, store: Placement | TieredStore, namespace: KeyNamespace, block_tokens: int, ranks: int,
                 kv_cache_manager: Any = None, promote_timeout_s: float = 5.0, async_saves: bool = False) -> None:
        self.promote_timeout_s = promote_timeout_s
        # Workers copy on a device stream and settle saves after the step
        # (worker.py): a finished request's blocks are freed only once its
        # saves are reported done. False on CPU, where saves are synchronous.
        self.async_saves = async_saves
        self._settled_step = -1  # every step up to this one is reported done by all ranks
        # Steps some ranks have reported (how many), and the failed slots of
        # the reports that came with them, until the other ranks' arrive.
        self._partial: dict[int, int] = {}
        self._partial_failed: set[int] = set()
        self._delayed: dict[str, int] = {}  # request -> last save step, for the next plan
        self.promote_poll_s = 0.001
        # With nothing else scheduled, a wait holds up no one: it can be
        # longer (it ends at the first finished copy anyway), so that the
        # scheduler does not ask the pool every millisecond while its I/O
        # threads, on the same cores, do the work.
        self.idle_poll_s = 0.01
        self._idle_pass = False  # the last planned step scheduled no tokens
        # Embedded or the node's pool: the same calls (placement.py).
        self.store: Placement = EmbeddedPlacement(store) if isinstance(store, TieredStore) else store
        self.block_tokens = block_tokens
        self.ranks = ranks
        self._seed = namespace.seed()
        # LoRA adapters: (id, path) -> the identity of the files first seen
        # for it, those changed since, and this process's own value for hub
        # adapters with no snapshot to pin them to.
        self._adapters: dict[tuple[Any, str], str] = {}
        self._changed_adapters: set[tuple[Any, str]] = set()
        self._nonce = os.urandom(8).hex()
        self._reqs: dict[str, _ReqState] = {}
        self._step = 0
        self._waited_step = -1  # the step counter at the last wait for a promotion
        self._loads_this_step: list[BlockCopy] = []
        # The placement's epoch before the step's first pin or save (None:
        # none yet). Slots are only good in the session that gave them.
        self._plan_epoch: int | None = None
        # Per planned step: request -> first block index it loads or saves in
        # that step. If the step's copies fail, those requests go back there,
        # so that the blocks vLLM recomputes are saved again.
        self._rewind: dict[int, dict[str, int]] = {}
        # Per planned step: request -> its device blocks from the first one
        # it loads on (the loaded ones and those the step computes after
        # them), for :meth:`_evict_from_device_cache`.
        self._loading: dict[str, int] = {}  # this step: request -> first block it loads
        self._after_load: dict[int, dict[str, list[int]]] = {}
        self.kv_cache_manager = kv_cache_manager
        self._stats = KvtierStats()
        self._last_counters: dict[str, int] = {}
        self._last_gauges: dict[str, int] = {}

    # --- keys -------------------------------------------------------------

    @staticmethod
    def _now_uncacheable(st: _ReqState) -> bool:
        """Whether the request's tokens no longer name its KV: multimodal or
        embedding inputs, looked at again each time, since a streaming-input
        session can gain images after its first part (vLLM adds them to the
        same request). Once true it stays true."""
        if not st.uncacheable:
            request = st.request
            st.uncacheable = bool(getattr(request, "mm_features", None)) or \
                getattr(request, "prompt_embeds", None) is not None
        return st.uncacheable

    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request, seed=self._seed)
            lora = getattr(request, "lora_request", None)
            salt = getattr(request, "cache_salt", None)
            self._now_uncacheable(st)
            adapter: str | None = ""
            if lora is not None:
                adapter = self._adapter_identity(lora)
                if adapter is None:
                    # Nothing names the weights this adapter computes with: its KV is never shared.
                    st.uncacheable = True
            if lora is not None or salt:
                # Same tokens under another adapter or tenant salt are other KV.
                # JSON, so that no adapter path and salt pair reads as another.
                tag = json.dumps(["lora", adapter or "", salt or ""])
                st.seed = digest16(self._seed + tag.encode())
            self._reqs[request.request_id] = st
        return st

    def _adapter_identity(self, lora: Any) -> str | None:
        """What names a LoRA adapter's weights, or None when nothing does.

        Not lora_name or lora_int_id (the id is load order: after a restart it
        names another adapter, whose blocks an SSD tier still holds) but its
        files: a local directory by its path and a digest of its files
        (cached by their size and mtime); a hub id by the snapshot in the
        Hugging Face cache that vLLM loads it from, digested the same way,
        else by a value unique to this process (the name alone would carry
        blocks over to an updated adapter). vLLM keeps the weights it loaded
        first for an id until a request asks ``load_inplace``: an adapter
        whose files changed under the same id without that may be computing
        with the old weights or, once reloaded after an eviction, the new
        ones, so its requests are not cached until it is loaded in place.
        """
        from kvtier.connector.connector import _hub_snapshot
        from kvtier.keys import directory_digest

        raw = str(getattr(lora, "lora_path", "") or "")
        path = os.path.expanduser(raw)
        try:
            if os.path.isdir(path):
                ident = os.path.abspath(path) + "#" + directory_digest(path)
            elif raw and not os.path.isabs(path) and not os.path.exists(path):
                snapshot = _hub_snapshot(raw, None, None, filename="adapter_config.json")
                ident = (f"{raw}@{os.path.basename(snapshot)}#{directory_digest(snapshot)}" if snapshot
                         else f"{raw}#unpinned-{self._nonce}")
            else:
                return None
        except OSError:
            return None
        which = (getattr(lora, "lora_int_id", None), raw)
        first = self._adapters.get(which)
        if first is None or getattr(lora, "load_inplace", False):
            self._adapters[which] = ident
            return ident
        if first != ident:
            if which not in self._changed_adapters:
                self._changed_adapters.add(which)
                log.warning("kvtier: the files of LoRA adapter %s (id %s) changed while it is loaded; its "
                            "requests are not cached until a request loads it in place (load_inplace)",
                            raw, which[0])
            return None
        return ident

    def _keys(self, st: _ReqState, num_tokens: int, run: bool = False) -> list[bytes]:
        """Keys of the full blocks among the request's first ``num_tokens``
        tokens; ``run``: as a :class:`KeyRun`, for calls that may send them."""
        want = num_tokens // self.block_tokens
        have = len(st.keys)
        if want > have:
            tokens = st.request.all_token_ids
            want = min(want, len(tokens) // self.block_tokens)
            if want > have:
                end = want * self.block_tokens
                new = (block_keys(st.seed, tokens[have * self.block_tokens : end], self.block_tokens)
                       if have == 0 else
                       block_keys(st.seed, tokens[:end], self.block_tokens, start=have, parent=st.keys[-1]))
                st.keys.extend(new)
                st.packed += b"".join(new)
        return _run(st, 0, want) if run else st.keys[:want]

    # --- vLLM hooks -------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Hash the prompt's blocks when the request arrives, not while it waits to be scheduled."""
        self._keys(self._state(request), request.num_tokens - 1)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if self._now_uncacheable(st):
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            # vLLM counts no hit for it whatever is answered: no lookup, no
            # promotion from SSD and no wait for one (its blocks are saved).
            return 0, False
        # At least one token must be computed to produce logits.
        limit = request.num_tokens - 1
        keys = self._keys(st, limit, run=True)
        ready, total, remote = self._lookup(keys, num_computed_tokens)
        hit = ready
        if total > ready and total * self.block_tokens > num_computed_tokens:
            # Part of the prefix is on SSD: promote it to DRAM and have vLLM ask
            # again (None) until it is there, or until the wait is too long.
            now = time.monotonic()
            if st.waiting_since is None:
                st.waiting_since = now
            if now - st.waiting_since < self.promote_timeout_s:
                wanted = keys[ready:total]
                moving = self.store.promote(wanted)
                if moving:
                    st.disk_keys.update(wanted[:moving])
                    if remote:
                        # Held only by another node: vLLM counts these as p2p hits.
                        st.p2p_keys.update(keys[total - remote : total])
                    # vLLM asks again on its next pass, at once when it has
                    # nothing else to run. Give the I/O threads the GIL for a
                    # moment first: a scheduler spinning on this lookup held
                    # it so tightly that each read waited out Python's 5 ms
                    # switch interval (bench/ssd.py). Once per pass (the
                    # step counter moves in build_connector_meta), not once
                    # per waiting request: N of them made every step, decodes
                    # included, N waits longer (issue 7, item 9).
                    if self._waited_step != self._step:
                        self._waited_step = self._step
                        self.store.wait_progress(self.idle_poll_s if self._idle_pass else self.promote_poll_s)
                    return None, False
                # Nothing left to move: what the lookup saw on its way may
                # have arrived since (a fetch or promotion that ended between
                # the two calls). Count what is there now, not the stale
                # ready run, or the rest of the hit is silently recomputed.
                hit = self._lookup(keys, num_computed_tokens)[0]
        st.waiting_since = None
        st.hit_blocks = hit
        st.device_tokens = num_computed_tokens
        ext = hit * self.block_tokens - num_computed_tokens
        if ext <= 0 or num_computed_tokens % self.block_tokens:
            return 0, False
        return ext, False

    def _lookup(self, keys: list[bytes], device_tokens: int) -> tuple[int, int, int]:
        """(ready, held, held only by another node): the blocks of ``keys``
        the pool holds from the first on, ready in DRAM, anywhere, and of
        those the last held only remotely. When vLLM's own cache covers the
        first ``device_tokens`` and the pool's DRAM run ends before them,
        the run is counted from there: only blocks past vLLM's hit are
        loaded, so only those are waited for when on SSD (not the part vLLM
        holds). The whole prefix is still looked up first: its blocks stay
        recent in the pool's order, heads with their tails."""
        probe = self.store.probe(keys)
        start = device_tokens // self.block_tokens
        if probe.ready < start < probe.total and not device_tokens % self.block_tokens:
            tail = self.store.probe(keys[start:])
            return start + tail.ready, start + tail.total, tail.remote
        return probe.ready, probe.total, probe.remote

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        first = st.device_tokens // self.block_tokens
        last = (st.device_tokens + num_external_tokens) // self.block_tokens
        block_ids = blocks.get_block_ids()[0]
        keys = _run(st, first, last)
        st.load_keys = keys
        marks = self._rewind.setdefault(self._step, {})
        marks[request.request_id] = min(marks.get(request.request_id, first), first)
        self._loading[request.request_id] = first
        self._note_epoch()
        slots = self.store.pin(keys, self._step)
        null = self._null_block_id()
        for i, (key, slot) in enumerate(zip(keys, slots)):
            # A slot that vanished since the lookup is planned with slot -1:
            # the worker reports the block as a load error and vLLM recomputes.
            block_id = block_ids[first + i]
            self._loads_this_step.append(BlockCopy(block_id, -1 if slot is None or block_id == null else slot, key))
        # Blocks loaded from the pool are already there; never save them again.
        st.saved_blocks = max(st.saved_blocks, last)

    def _null_block_id(self) -> int:
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        null = getattr(pool, "null_block", None)
        return getattr(null, "block_id", -1)

    def fail_load(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Plan the request's external blocks as failed loads (slot -1): vLLM
        recomputes them instead of using blocks nothing was copied into."""
        st = self._reqs.get(request.request_id)
        first = (st.device_tokens if st else request.num_computed_tokens) // self.block_tokens
        last = first + num_external_tokens // self.block_tokens
        block_ids = blocks.get_block_ids()[0]
        self._loads_this_step.extend(BlockCopy(block_ids[i], -1, b"") for i in range(first, last))
        self._loading[request.request_id] = first

    def failed_step_plan(self) -> StepPlan:
        """A plan for a step whose planning failed: every planned load fails, nothing is saved."""
        plan = StepPlan(step=self._step, arena=self.store.arena_path,
                        loads=[BlockCopy(c.block_id, -1, c.key) for c in self._loads_this_step],
                        delayed=self._take_delayed())
        self.store.abandon_saves(self._step)  # slots taken before the failure: no one will write them
        self._note_loading()
        # Requests planned before the failure moved their "saved up to" mark
        # past those abandoned saves: back to where this step started, so the
        # blocks are planned again in the next step.
        for req_id, first in self._rewind.get(self._step, {}).items():
            st = self._reqs.get(req_id)
            if st is not None:
                st.saved_blocks = min(st.saved_blocks, first)
        self._loads_this_step = []
        self._plan_epoch = None
        self._step += 1
        return plan

    def _note_epoch(self) -> None:
        """Before a call that hands out slots: the epoch they belong to."""
        if self._plan_epoch is None:
            self._plan_epoch = self.store.epoch

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        step = self._step
        # Loads stay queued until the plan is complete: if planning fails
        # half-way, failed_step_plan() still reports every one of them.
        plan = StepPlan(step=step, arena=self.store.arena_path, loads=list(self._loads_this_step))
        sched = scheduler_output.num_scheduled_tokens
        self._idle_pass = not sched
        for req_id, n_sched in sched.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            st.planned_tokens = st.request.num_computed_tokens + n_sched  # (vLLM adds them after this call)
            if self._now_uncacheable(st):
                continue
            req = st.request
            done_tokens = min(req.num_computed_tokens + n_sched, len(req.all_token_ids))
            n_full = done_tokens // self.block_tokens
            if n_full <= st.saved_blocks:
                continue
            keys = self._keys(st, n_full * self.block_tokens)
            n_full = len(keys)
            block_ids = self.kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            marks = self._rewind.setdefault(step, {})
            marks[req_id] = min(marks.get(req_id, st.saved_blocks), st.saved_blocks)
            null = self._null_block_id()
            # vLLM's shared null block never holds a request's KV: never saved.
            pairs = [(i, block_ids[i], keys[i]) for i in range(st.saved_blocks, n_full) if block_ids[i] != null]
            self._note_epoch()
            slots = self.store.prepare_save([k for _, _, k in pairs], step)
            for (_, block_id, key), slot in zip(pairs, slots):
                if slot is not None:
                    plan.saves.append(BlockCopy(block_id, slot, key))
                    st.last_save_step = step
            # A block that got no slot for lack of room is planned again in a
            # later step: the mark stops there (blocks after it that did get
            # a slot are held by then, and skipped).
            st.saved_blocks = pairs[slots.placed][0] if slots.placed < len(pairs) else n_full
        self._note_loading()
        # The arena first, then the epoch: a reconnection that changed the
        # arena has changed the epoch before it (PoolPlacement._install_locked).
        arena = self.store.arena_path
        if self._plan_epoch is not None and self.store.epoch != self._plan_epoch:
            # The placement reconnected while the step was planned: slots
            # from the session before mean nothing now (the service released
            # them, or a restarted one made another arena). Nothing of the
            # step is copied; its blocks are computed and saved again.
            log.warning("kvtier: the pool's session changed while step %d was planned; its loads fail into "
                        "recompute and its saves are planned again", step)
            return self.failed_step_plan()
        self._plan_epoch = None
        plan.arena = arena
        plan.delayed = self._take_delayed()
        self._loads_this_step = []
        self._step += 1
        return plan

    def _note_loading(self) -> None:
        """Record, for the step being planned, each loading request's device
        blocks from its first loaded one on (the step computes the blocks
        after the loaded ones on top of them)."""
        loading, self._loading = self._loading, {}
        marks: dict[str, list[int]] = {}
        for req_id, first in loading.items():
            try:
                marks[req_id] = list(self.kv_cache_manager.get_blocks(req_id).get_block_ids()[0][first:])
            except Exception:  # noqa: BLE001 - only the eviction after a failed load needs it
                log.debug("kvtier: blocks of request %s not found", req_id)
        if marks:
            self._after_load[self._step] = marks
        for old in [x for x in self._after_load if x < self._step - AFTER_LOAD_STEPS]:
            del self._after_load[old]

    def _evict_from_device_cache(self, invalid: set[int]) -> None:
        """Take the blocks of a failed load out of vLLM's prefix cache, with
        the blocks of the same request computed after them in that step.

        With ``kv_load_failure_policy: recompute`` vLLM recomputes those
        blocks in place for the requests still running when the failure is
        reported, but leaves them in its prefix cache: a request aborted or
        preempted in between (asynchronous scheduling) would leave bad KV
        there for the next request with the same prefix to hit, and for
        kvtier to save again. The requests holding the blocks keep them;
        only their hashes go (a block reused since by another request only
        loses its cache entry).
        """
        bad = set(invalid)
        for marks in self._after_load.values():
            for ids in marks.values():
                hit = next((i for i, b in enumerate(ids) if b in invalid), None)
                if hit is not None:
                    bad.update(ids[hit:])
        evict = getattr(self.kv_cache_manager, "evict_blocks", None)
        if evict is None:
            return
        try:
            evict(bad)
        except Exception:  # noqa: BLE001 - the engine never fails because of the cache
            log.exception("kvtier: evicting the blocks of a failed load from vLLM's prefix cache failed")

    def _drop_outputs_in_flight(self, invalid: set[int]) -> None:
        """Under asynchronous scheduling, drop the outputs still in flight of
        the requests vLLM just moved back because of a block that failed to
        load: those steps were planned before the failure was known, and
        computed on the bad block (or on a token sampled from it).

        vLLM's handling (``kv_load_failure_policy: recompute``) moves
        ``num_computed_tokens`` back: to the failed block for the request
        that loaded it, by the step's tokens for one that shares the block
        through vLLM's prefix cache. But the request's next step, already
        running, still delivers the token it sampled. The block reported
        again with that step catches it only while vLLM's window for it
        (what is computed now less what that step scheduled) still reaches
        the block, which a small token budget defeats, and not at all for
        the steps after it. Such a request is marked as vLLM marks a
        preempted one in drop mode (its ``num_stale_output_tokens`` are
        drained and discarded on arrival), and its output placeholders,
        which the skipped outputs never consumed, are cleared.

        A request counts as moved back when it holds a failed block its
        planned steps reached, its computed tokens went below what its last
        planned step leaves, and it is in its prompt again (not a decode
        step's rejected drafts). Runs after vLLM's handling:
        ``update_connector_output`` comes once the step's outputs are applied."""
        get = getattr(self.kv_cache_manager, "get_blocks", None)
        if get is None:
            return
        for req_id, st in list(self._reqs.items()):
            request, planned = st.request, st.planned_tokens
            computed = request.num_computed_tokens
            if planned is None or computed >= planned or computed >= request.num_tokens:
                continue
            try:
                ids = get(req_id).get_block_ids()[0]
            except Exception:  # noqa: BLE001 - not scheduled (or gone): nothing of it in flight to judge
                continue
            first = next((i for i, b in enumerate(ids) if b in invalid), None)
            if first is None or first * self.block_tokens >= planned:
                continue  # holds no failed block its steps reached
            in_flight = getattr(request, "num_in_flight_tokens", 0)
            if in_flight:
                request.drop_stale_output = True
                request.num_stale_output_tokens = in_flight
                if getattr(request, "spec_token_ids", None):
                    request.spec_token_ids = []
                log.info("kvtier: request %s moved back after a failed load; its %d tokens in flight are dropped",
                         req_id, in_flight)
            request.num_output_placeholders = 0
            st.planned_tokens = computed

    def _take_delayed(self) -> dict[str, int]:
        delayed, self._delayed = self._delayed, {}
        return delayed

    def update_connector_output(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        invalid = getattr(output, "invalid_block_ids", None)
        if isinstance(report, StepReport):
            if report.failed_slots or invalid:
                for step in report.done:
                    for req_id, first in self._rewind.get(step, {}).items():
                        st = self._reqs.get(req_id)
                        if st is not None:
                            st.saved_blocks = min(st.saved_blocks, first)
            if report.done:
                # Steps finish in order: marks of this step and of any earlier
                # step that had nothing to report are done with.
                last_done = max(report.done)
                for step in [s for s in self._rewind if s <= last_done]:
                    del self._rewind[step]
            if report.failed_slots and self._partial:
                self._partial_failed.update(report.failed_slots)
            for step, n in sorted(report.done.items()):
                # Each rank reports a step once its own copies are done (on a
                # device, when its event completes): ranks may report one
                # step in different outputs. It is settled once all have.
                total = self._partial.pop(step, 0) + n
                if total < self.ranks:
                    self._partial[step] = total
                    self._partial_failed.update(report.failed_slots)
                    continue
                self._settled_step = max(self._settled_step, step)
                failed = report.failed_slots
                if self._partial_failed:
                    failed = sorted(self._partial_failed.union(failed))
                # Every rank has finished the steps before this one too
                # (reports go in step order): complete_step settles them.
                for earlier in [s for s in self._partial if s < step]:
                    del self._partial[earlier]
                if not self._partial:
                    self._partial_failed.clear()
                self.store.complete_step(step, failed_slots=failed)
            if report.corrupt_keys:
                # After complete_step, so that the step's own pins no longer hold them.
                self.store.discard(report.corrupt_keys)
                self._stats.add("corrupt_blocks", len(report.corrupt_keys))
        if invalid:
            self._evict_from_device_cache(set(invalid))
            # A load failed: the workers dropped that step's saves; steps
            # planned since (asynchronous scheduling) may have computed on the
            # bad blocks too, so their saves never become readable either.
            # Their requests go back to where those steps started, so that
            # the blocks are saved again once (re)computed.
            # Without a report (held back until earlier saves finish), the
            # failed step is any not yet settled: with pipeline stages
            # several steps are in flight, so every unsettled one is doomed.
            last = max(report.done) if isinstance(report, StepReport) and report.done else self._settled_step
            for step, marks in self._rewind.items():
                if step > last:
                    for req_id, first in marks.items():
                        st = self._reqs.get(req_id)
                        if st is not None:
                            st.saved_blocks = min(st.saved_blocks, first)
            self.store.doom_pending(last)
            try:  # last: should it fail, the saves above are doomed all the same
                self._drop_outputs_in_flight(set(invalid))
            except Exception:  # noqa: BLE001
                log.exception("kvtier: dropping the outputs in flight of requests rolled back failed")

    def reset_cache(self) -> int:
        """vLLM's reset (after a weight update): nothing from before it may
        match again. Returns how many entries the store dropped or doomed.

        The store dooms what it cannot drop (see :meth:`TieredStore.clear`).
        The key seed takes a random 64-bit nonce, so keys made after the
        reset never equal keys made before it, and a restart (plain seed
        again) never finds blocks saved after it. Every request's state is
        dropped: a request that comes back through a lookup (new, or
        preempted by the reset) gets keys under the new seed; one that keeps
        running was computed before the reset and is saved no more.
        """
        # The seed first: should the store's reset fail, nothing from before
        # it matches all the same.
        self._seed = digest16(self._seed + os.urandom(8))
        self._reqs.clear()
        return self.store.reset()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        if not num_external_tokens:
            return {}
        st = self._reqs.get(request.request_id)
        disk = p2p = 0
        if st is not None and st.disk_keys:
            p2p = sum(1 for k in st.load_keys if k in st.p2p_keys) * self.block_tokens
            disk = sum(1 for k in st.load_keys if k in st.disk_keys and k not in st.p2p_keys) * self.block_tokens
        p2p = min(p2p, num_external_tokens)
        disk = min(disk, num_external_tokens - p2p)
        out = {CacheHitSource.HOST: num_external_tokens - disk - p2p, CacheHitSource.DISK: disk,
               CacheHitSource.P2P: p2p}
        return {src: n for src, n in out.items() if n}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """True (vLLM keeps the blocks) while a save of this request may
        still be reading them; the workers report it in ``get_finished``."""
        st = self._reqs.pop(request.request_id, None)
        if self.async_saves and st is not None and st.last_save_step > self._settled_step:
            self._delayed[request.request_id] = st.last_save_step
            return True, None
        return False, None

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The store's counters since the last call, and its gauges when anything changed."""
        now = self.store.counters()
        stats = self._stats
        changed = False
        for name, value in now.items():
            if name in GAUGES:
                continue
            d = value - self._last_counters.get(name, 0)
            if d < 0:
                d = value  # a restarted meta service counts from zero again
            if d:
                stats.add(name, d)
                changed = True
        gauges = {g: now.get(g, 0) for g in GAUGES}  # none yet from a pool not reached since start
        if not changed and stats.is_empty() and gauges == self._last_gauges:
            return None
        self._last_counters = now
        self._last_gauges = gauges
        self._stats = KvtierStats()
        stats.data.update(gauges)
        return stats

    def shutdown(self) -> None:
        """Stop the store's I/O, close the SSD tier, then close and remove the arena.

        The arena goes even if stopping the rest fails. vLLM calls this only
        when the engine core gets time to shut down; on the usual stop it is
        killed first and the arena's reaper removes it (tier/dram.py).
        """
        self.store.shutdown()


ARENA_PREFIX = "kvtier-dram-"


def arena_path(shm_dir: str, engine_id: str) -> str:
    """Where the engine's DRAM arena lives: ``kvtier-dram-<pid>-<engine_id>``.

    The pid keeps names of engines in one container apart and tells an
    operator whose arena it is; whether its owner is alive is decided by
    the owner's lock on the file, never by the pid (see
    :func:`remove_stale_arenas`).
    """
    return os.path.join(shm_dir, f"{ARENA_PREFIX}{os.getpid()}-{engine_id}")


def remove_stale_arenas(shm_dir: str) -> list[str]:
    """Remove arenas whose owner is gone (killed engines); return their names.

    Liveness is the owner's ``flock`` on its arena, which works across
    containers sharing ``/dev/shm`` (``--ipc=host``), where ``kill(pid, 0)``
    cannot see the other container's processes and called live arenas
    stale. This process's own arena is locked too, so it is kept.
    """
    from kvtier.tier.dram import remove_stale_files

    return remove_stale_files(shm_dir, ARENA_PREFIX)
