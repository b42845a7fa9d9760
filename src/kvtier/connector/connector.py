"""KvtierConnector: the class vLLM loads; it dispatches to one half by role.

vLLM builds one instance in its engine-core process (role SCHEDULER) and
one in each worker process (role WORKER). ``build_*`` functions below wire
each half once per process; the halves themselves take parts already built.

Load with::

    --kv-transfer-config '{"kv_connector":"KvtierConnector",
      "kv_connector_module_path":"kvtier.connector","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"backend":"embedded","dram_size":"2GB"}}'
"""

from __future__ import annotations

import hashlib
import logging
import os

import xxhash
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvtier.config import KvtierConfig, check_dram_fits, parse_connector_config
from kvtier.connector.meta import StepPlan
from kvtier.connector.scheduler import SchedulerSide, arena_path, remove_stale_arenas
from kvtier.connector.stats import KvtierPromMetrics, KvtierStats
from kvtier.connector.worker import WorkerSide
from kvtier.errors import ConfigError
from kvtier.keys import KeyNamespace
from kvtier.store import TieredStore
from kvtier.tier.dram import DramTier
from kvtier.tier.ssd import SsdTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvtier")


def _log_through_vllm() -> None:
    """Send kvtier's log records to vLLM's handlers, so they show in the server's log."""
    vllm_log = logging.getLogger("vllm")
    if not log.handlers and vllm_log.handlers:
        for handler in vllm_log.handlers:
            log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


_log_through_vllm()

_LAYER_ALIGN = 64


def _full_attention_spec(kv_cache_config: KVCacheConfig) -> tuple[Any, list[str]]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError("kv_cache_groups", len(groups),
                          "kvtier supports models with one KV cache group (full attention) only")
    spec = groups[0].kv_cache_spec
    # Sliding-window and chunked-local layers keep vLLM's shared null block
    # in their block tables outside the window: a "block" there is not KV of
    # those tokens, so such models are refused rather than cached wrongly.
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) \
            or getattr(spec, "attention_chunk_size", None):
        raise ConfigError("kv_cache_spec", type(spec).__name__,
                          "kvtier supports full attention only (no sliding window or chunked local attention)")
    return spec, list(groups[0].layer_names)


def _weights_digest(model_dir: str, samples: int = 16, chunk: int = 1 << 16) -> str:
    """Digest of the weight files' names, sizes and sampled bytes.

    A fine-tune usually keeps config.json unchanged, so the config alone
    would let a new checkpoint under the same path hit the old one's blocks
    (on SSD, across restarts). Reading ``samples`` chunks spread over each
    file costs a few MiB at start-up; ``model_id`` overrides all of this.
    """
    h = xxhash.xxh3_128()
    names = sorted(n for n in os.listdir(model_dir)
                   if n.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")))
    for name in names:
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        h.update(f"{name}:{size};".encode())
        with open(path, "rb") as f:
            for i in range(samples):
                f.seek(size * i // samples)
                h.update(f.read(chunk))
    return h.hexdigest()[:16]


def _model_identity(vllm_config: VllmConfig, cfg: KvtierConfig) -> str:
    mc = vllm_config.model_config
    # What else changes the bytes of K and V for the same weights.
    extra = f"|quant={getattr(mc, 'quantization', None)}|overrides={getattr(mc, 'hf_overrides', None)!r}"
    if cfg.model_id:
        return cfg.model_id + extra
    ident = f"{mc.model}@{mc.revision or ''}"
    conf = os.path.join(str(mc.model), "config.json")
    if os.path.isfile(conf):
        # A local directory: the same path may hold another model tomorrow.
        with open(conf, "rb") as f:
            ident += "#" + hashlib.sha256(f.read()).hexdigest()[:16]
        ident += "#" + _weights_digest(str(mc.model))
    return ident + extra


def namespace_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KvtierConfig) -> KeyNamespace:
    from vllm.platforms import current_platform

    spec, layers = _full_attention_spec(kv_cache_config)
    attn = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    layout = (f"{current_platform.device_type}/{getattr(attn, 'name', attn) or 'auto'}/"
              f"{len(layers)}x{spec.num_kv_heads}x{spec.head_size}/{type(spec).__name__}")
    pc = vllm_config.parallel_config
    return KeyNamespace(model=_model_identity(vllm_config, cfg), dtype=str(spec.dtype), layout=layout,
                        block_tokens=spec.block_size, tp_size=pc.tensor_parallel_size,
                        pp_size=pc.pipeline_parallel_size)


def build_scheduler_side(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                         cfg: KvtierConfig) -> SchedulerSide:
    spec, layers = _full_attention_spec(kv_cache_config)
    ns = namespace_for(vllm_config, kv_cache_config, cfg)
    pc = vllm_config.parallel_config
    ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
    # Each rank holds its own layers; with PP a rank has a share, so size for all.
    rank_bytes = -(-spec.page_size_bytes // _LAYER_ALIGN) * _LAYER_ALIGN * len(layers)
    engine_id = vllm_config.kv_transfer_config.engine_id or "0"
    tier = DramTier.create(arena_path(cfg.shm_dir, engine_id), cfg.dram_size_bytes, rank_bytes, ranks)
    ssd = None
    recovered: list = []
    if cfg.ssd_paths:
        try:
            ssd, recovered = SsdTier.open(cfg.ssd_paths, cfg.ssd_size_bytes, tier.slot_stride, cfg.force_new_disk)
        except BaseException:
            tier.close()
            raise
    store = TieredStore(tier, cfg.evict_threshold_high, cfg.evict_threshold_low, ssd=ssd,
                        ssd_high_pct=cfg.ssd_evict_threshold_high, ssd_low_pct=cfg.ssd_evict_threshold_low,
                        dram_watermark_pct=cfg.rewarm_dram_watermark, io_threads=cfg.io_threads,
                        demote_queue_blocks=cfg.demote_queue_blocks, recovered=recovered)
    log.info("kvtier: DRAM tier %s, %d slots of %d bytes (%.2f GiB), block of %d tokens",
             tier.path, tier.num_slots, tier.slot_stride, tier.size_bytes / (1 << 30), spec.block_size)
    if ssd is not None:
        log.info("kvtier: SSD tier on %s: %d slots, %d blocks recovered", ":".join(ssd.paths), ssd.num_slots,
                 len(recovered))
    return SchedulerSide(store, ns, spec.block_size, ranks, promote_timeout_s=cfg.promote_timeout_s)


def build_worker_side(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KvtierConfig) -> WorkerSide:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = vllm_config.parallel_config.tensor_parallel_size
    rank = get_pp_group().rank_in_group * tp + get_tp_group().rank_in_group
    return WorkerSide(rank, kv_cache_config.num_blocks, cfg.verify_checksums)


class KvtierConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvtier's pool."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        try:
            cfg = parse_connector_config(extra, check_memory=False)
            if role == KVConnectorRole.SCHEDULER:
                # Arenas of killed engines go first: on huge pages they hold
                # exactly the pages this start needs.
                removed = remove_stale_arenas(cfg.shm_dir)
                if removed:
                    log.info("kvtier: removed %d arenas left by dead processes", len(removed))
                check_dram_fits(cfg)
            # Opening the tiers can refuse a path (mounted, held, no direct
            # I/O): that is a configuration error too, shown as one line.
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = build_scheduler_side(vllm_config, kv_cache_config, cfg)
            else:
                self._worker = build_worker_side(vllm_config, kv_cache_config, cfg)
        except ConfigError as err:
            log.error("%s", err)
            raise

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is a future miss, never a correctness problem.
        return False

    # --- scheduler side ---------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.on_new_request(request)
            except Exception:  # noqa: BLE001 - keys are computed again at lookup
                log.exception("kvtier: hashing a new request failed")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - a lookup failure is a miss
            log.exception("kvtier: lookup failed; treating as a miss")
            return 0, False

    # Every hook below catches what the cache throws: the engine must never
    # fail because of the cache. Where vLLM already counts on a load, a
    # failure becomes load errors (vLLM recomputes); elsewhere it is a miss.

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: planning a load failed; its blocks will be recomputed")
            self._scheduler.fail_load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        assert self._scheduler is not None
        try:
            return self._scheduler.build_connector_meta(scheduler_output)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: planning step copies failed; this step loads nothing and saves nothing")
            return self._scheduler.failed_step_plan()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.update_connector_output(connector_output)
            except Exception:  # noqa: BLE001
                log.exception("kvtier: processing the workers' report failed")

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        assert self._scheduler is not None
        try:
            return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: splitting hits by source failed")
            return super().get_external_cache_hit_sources(request, num_external_tokens)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        try:
            return self._scheduler.request_finished(request, block_ids)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: request_finished failed")
            return False, None

    def reset_cache(self) -> bool | None:
        if self._scheduler is None:
            return None
        try:
            n = self._scheduler.store.clear()
        except Exception:  # noqa: BLE001
            log.exception("kvtier: reset failed")
            return False
        log.info("kvtier: reset dropped %d blocks", n)
        return True

    # --- worker side ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        try:
            self._worker.start_load_kv(plan)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: loading failed; vLLM recomputes the step's %d blocks", len(plan.loads))
            self._worker.fail_loads(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves happen for all layers at once in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            plan = self._get_connector_metadata()
            assert isinstance(plan, StepPlan)
            try:
                self._worker.wait_for_save(plan)
            except Exception:  # noqa: BLE001
                log.exception("kvtier: saving failed; the step's %d blocks are not kept", len(plan.saves))
                self._worker.fail_saves(plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.build_report() if self._worker is not None else None

    # --- both -------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvtierStats | None:
        half = self._scheduler or self._worker
        try:
            return half.get_kv_connector_stats() if half is not None else None
        except Exception:  # noqa: BLE001 - statistics are never worth a failed step
            log.exception("kvtier: collecting statistics failed")
            return None

    def shutdown(self) -> None:
        half = self._scheduler or self._worker
        if half is not None:
            half.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
