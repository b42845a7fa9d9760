"""KvtierConnector: the class vLLM loads; it dispatches to one half by role.

vLLM builds one instance in its engine-core process (role SCHEDULER) and
one in each worker process (role WORKER). ``build_*`` functions below wire
each half once per process; the halves themselves take parts already built.

Start-up, scheduler role, in this order: the configuration is parsed and
checked against vLLM's (:func:`check_vllm_config`: context parallelism,
load-failure policy, data parallelism with an SSD tier); a run in which
vLLM itself has prefix caching off leaves the connector inert
(:func:`inert_reason`); the KV cache spec is checked
(:func:`kv_cache_spec`); stale arenas are removed, memory is checked, and
the tiers are built (:func:`build_scheduler_side`).

Load with::

    --kv-transfer-config '{"kv_connector":"KvtierConnector",
      "kv_connector_module_path":"kvtier.connector","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"backend":"embedded","dram_size":"2GB"}}'
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvtier.config import KvtierConfig, check_dram_fits, keys_not_used, parse_connector_config
from kvtier.connector.meta import StepPlan
from kvtier.connector.scheduler import SchedulerSide, arena_path, remove_stale_arenas
from kvtier.connector.stats import KvtierPromMetrics, KvtierStats
from kvtier.connector.worker import WorkerSide
from kvtier.errors import ConfigError
from kvtier.hostmem import warm_interval_s
from kvtier.keys import KeyNamespace, directory_digest, file_digest
from kvtier.layout import LAYER_ALIGN
from kvtier.placement import EmbeddedPlacement, open_store

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

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# vLLM appends "_dp<rank>" to engine_id in every engine-core process of a
# data-parallel launch (run_engine_core), and a non-MoE rank then resets its
# data_parallel_size to 1: for DP rank 0 the suffix is the only trace left.
_DP_ENGINE_ID = re.compile(r"_dp\d+$")


# --- what kvtier refuses, and when it stays out of the way ---------------------


def check_vllm_config(vllm_config: VllmConfig, cfg: KvtierConfig) -> None:
    """Refuse vLLM settings under which kvtier would serve wrong KV or lose requests.

    Raises :class:`ConfigError` naming vLLM's setting and what to do.
    """
    pc = vllm_config.parallel_config
    dcp = getattr(pc, "decode_context_parallel_size", 1)
    if dcp > 1:
        # With DCP = N a vLLM block holds block_size x N tokens spread over
        # the ranks, while kvtier keys every block_size tokens and pairs
        # keys[i] with block_ids[i]: keys and blocks would not line up.
        raise ConfigError("decode_context_parallel_size", dcp,
                          "kvtier does not support decode context parallelism; "
                          "run without --decode-context-parallel-size (-dcp)", "vLLM")
    pcp = getattr(pc, "prefill_context_parallel_size", 1)
    if pcp > 1:
        # Workers that differ only in their PCP rank would compute the same
        # rank index and write the same part of every slot.
        raise ConfigError("prefill_context_parallel_size", pcp,
                          "kvtier does not support prefill context parallelism; "
                          "run without --prefill-context-parallel-size (-pcp)", "vLLM")
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        # Refused rather than forced: with vLLM's default "fail", every block
        # that fails its checksum ends a user's request with an error, and
        # changing vLLM's setting behind the user's back is a global side
        # effect of loading a connector.
        raise ConfigError("kv_load_failure_policy", policy,
                          'kvtier needs "kv_load_failure_policy": "recompute" in --kv-transfer-config, so that '
                          "a block that fails its checks is recomputed instead of failing the request",
                          "kv_transfer_config")
    if cfg.ssd_paths and not cfg.backend.shared:
        engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")
        dp_size = getattr(pc, "data_parallel_size", 1)
        dp_index = getattr(pc, "data_parallel_index", 0) or 0
        if dp_size > 1 or dp_index > 0 or _DP_ENGINE_ID.search(engine_id):
            raise ConfigError("ssd_path", ":".join(cfg.ssd_paths),
                              "with data parallelism every DP rank is an engine of its own and they would "
                              "all open this ssd_path; run one vLLM instance per DP rank, each with its own "
                              "ssd_path, or use one shared pool (backend: pool)", "kv_connector_extra_config")


def inert_reason(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """Why kvtier must do nothing in this run, or None.

    These are runs in which vLLM itself turns prefix caching off, because
    reusing a prefix's KV would be wrong (non-causal attention, R-SWA) or
    the user asked for it. They stay inert rather than refused: the model
    is served correctly without any cache, and refusing would stop a
    deployment that vLLM alone accepts; kvtier follows vLLM and says so in
    one line. Checked on the spec as well as on ``enable_prefix_caching``,
    so the answer does not depend on which process saw vLLM's change.
    """
    from vllm.v1.kv_cache_interface import RSWASpec

    if not vllm_config.cache_config.enable_prefix_caching:
        return "vLLM runs with prefix caching off (cache_config.enable_prefix_caching is False)"
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if getattr(spec, "non_causal", False):
            return (f"the model has non-causal attention layers ({type(spec).__name__}(non_causal=True)), "
                    "for which vLLM turns prefix caching off")
        if isinstance(spec, RSWASpec):
            return ("the model uses reference sliding-window attention (RSWASpec): the KV of generated "
                    "tokens is not a function of the prefix alone, and vLLM turns prefix caching off for it")
    return None


def kv_cache_spec(kv_cache_config: KVCacheConfig) -> tuple[Any, list[str]]:
    """The one KV cache spec kvtier caches, and its layer names; refuses others.

    Refused, not inert: vLLM keeps its own prefix cache on for these, so a
    user expects reuse, and a cache that silently did nothing would hide the
    mismatch. Only a spec that is exactly full attention or MLA is
    accepted: a subclass (RSWA, attention sinks, hidden-state caches) may
    keep blocks that are not the KV of their tokens.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError("kv_cache_groups", len(groups),
                          "kvtier supports models with one KV cache group (full attention) only")
    spec = groups[0].kv_cache_spec
    # Sliding-window and chunked-local layers keep vLLM's shared null block
    # in their block tables outside the window: a "block" there is not KV of
    # those tokens, so such models are refused rather than cached wrongly.
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        raise ConfigError("kv_cache_spec", type(spec).__name__,
                          "kvtier supports full attention only (no sliding window or chunked local attention)")
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConfigError("kv_cache_spec", type(spec).__name__,
                          "kvtier supports exactly FullAttentionSpec or MLAAttentionSpec layers")
    return spec, list(groups[0].layer_names)


# --- sizes ------------------------------------------------------------------------


def layers_per_rank(vllm_config: VllmConfig, num_layers: int, pp_rank: int = 0) -> int:
    """Layers of the largest pipeline stage, given that stage ``pp_rank`` has ``num_layers``.

    With uneven stages (30 layers over 4 stages: 7/8/8/7) the scheduler's
    KV cache config holds stage 0's layers, fewer than the middle stages'.
    Stage sizes come from vLLM's own partition (``get_pp_indices``, which
    honours ``VLLM_PP_LAYER_PARTITION``); layers beyond the hidden layers
    (a draft model's) are counted on every stage.
    """
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return num_layers
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    stages = [end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp))]
    extra = max(0, num_layers - stages[pp_rank])
    return max(num_layers, max(stages) + extra)


def rank_bytes_for(spec: Any, num_layers: int) -> int:
    """Bytes one rank writes per block: each layer's page padded to 64 bytes (layout.py)."""
    return -(-spec.page_size_bytes // LAYER_ALIGN) * LAYER_ALIGN * num_layers


# --- the key namespace --------------------------------------------------------------


def _canonical(value: Any) -> str:
    """A process-independent text for a config value (a callable by its name and code, not its address)."""
    if callable(value):
        try:
            code = hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            code = "nosource"
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}:{code}"
    return json.dumps(value, sort_keys=True, default=str)


def _hub_snapshot(model: str, revision: str | None, cache_dir: str | None,
                  filename: str = "config.json") -> str | None:
    """The local snapshot directory of a Hugging Face repository, from the
    cache alone (no network), found by a ``filename`` it holds (a LoRA
    adapter's repository has ``adapter_config.json``, no ``config.json``)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, filename, cache_dir=cache_dir, revision=revision)
    except Exception:  # noqa: BLE001 - not a repository id, or a malformed cache: not pinned
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def _local_identity(directory: str) -> str:
    conf = os.path.join(directory, "config.json")
    ident = ""
    if os.path.isfile(conf):
        with open(conf, "rb") as f:
            ident += "#" + hashlib.sha256(f.read()).hexdigest()[:16]
    # Weights, modelling code shipped beside them (trust_remote_code), and
    # every JSON file: vLLM reads more configs than config.json (params.json
    # with the mistral format, quantize_config.json, hf_quant_config.json).
    return ident + "#" + directory_digest(directory, _WEIGHT_SUFFIXES + (".py", ".json"), cached=False)


def _numerics(vllm_config: VllmConfig) -> str:
    """What else, for the same weights, changes the bytes of K and V (or may:
    kernels and the code around them): quantization and its per-layer
    settings, config overrides and the files the config is read from, the
    model length (LongRoPE-style scaling picks its factors by it), the
    implementation, how the weights are loaded, the attention settings,
    the draft model of speculative decoding, and the versions of vLLM and
    torch (a fixed kernel or rope bug changes the bytes)."""
    import torch
    import vllm

    mc = vllm_config.model_config
    lc = getattr(vllm_config, "load_config", None)
    sc = getattr(vllm_config, "speculative_config", None)
    spec = [getattr(sc, "method", None), getattr(sc, "model", None)] if sc is not None else None
    return (f"|quant={getattr(mc, 'quantization', None)}"
            f"|qconf={_canonical(getattr(mc, 'quantization_config', None))}"
            f"|overrides={_canonical(getattr(mc, 'hf_overrides', None))}"
            f"|hfconf={getattr(mc, 'hf_config_path', None)}|format={getattr(mc, 'config_format', None)}"
            # As given (None, -1 for auto, or a length): with auto vLLM later
            # shrinks max_model_len in place to fit the free memory, after the
            # model (and its rope) was built.
            f"|maxlen={getattr(mc, 'original_max_model_len', getattr(mc, 'max_model_len', None))}"
            f"|impl={getattr(mc, 'model_impl', None)}"
            f"|classes={_canonical(getattr(mc, 'model_class_overrides', None))}"
            f"|load={getattr(lc, 'load_format', None)}:{_canonical(getattr(lc, 'model_loader_extra_config', None))}"
            f"|attn={_canonical(getattr(vllm_config, 'attention_config', None))}"
            f"|spec={_canonical(spec)}"
            f"|vllm={vllm.__version__}|torch={torch.__version__}")


def _model_identity(vllm_config: VllmConfig, cfg: KvtierConfig) -> str:
    """The model part of the namespace: which weights, and what changes their numerics.

    A local directory is named by its path and the digests of its config and
    weights (the same path may hold another model tomorrow); a local file
    (GGUF) by its path and digest. A hub repository is pinned to the commit
    of its snapshot in the Hugging Face cache (read offline, as vLLM loaded
    it) and digested like a directory. When no commit can be found and the
    revision given is not a commit hash, the weights behind the name can
    change between runs: the identity then gets a value unique to this
    process, so blocks are shared within the run but never with another
    (an SSD tier recovered later holds nothing that matches). ``model_id``
    replaces all of this.
    """
    mc = vllm_config.model_config
    extra = _numerics(vllm_config)
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    if load_format.lower().endswith("dummy"):
        # Random weights (benchmarks): never the model's blocks, nor another run's.
        log.warning("kvtier: load_format %s (random weights): blocks are shared within this run only",
                    load_format)
        return f"{mc.model}#dummy-{uuid.uuid4().hex}" + extra
    if cfg.model_id:
        return cfg.model_id + extra
    model = str(mc.model)
    if os.path.isdir(model):
        return model + _local_identity(model) + extra
    if os.path.isfile(model):
        return model + "#" + file_digest(model) + extra
    revision = getattr(mc, "revision", None)
    load_config = getattr(vllm_config, "load_config", None)
    snapshot = _hub_snapshot(model, revision, getattr(load_config, "download_dir", None))
    code = f"|code={mc.code_revision}" if getattr(mc, "code_revision", None) else ""
    if snapshot is not None:
        return f"{model}@{os.path.basename(snapshot)}" + _local_identity(snapshot) + code + extra
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return f"{model}@{revision}" + code + extra
    log.warning("kvtier: cannot pin model %s to a commit (no snapshot in the Hugging Face cache, "
                "revision %r); its blocks are not reused across restarts: set model_id to share them",
                model, revision)
    return f"{model}@{revision or ''}#unpinned-{uuid.uuid4().hex}" + code + extra


def _layout_description(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, spec: Any,
                        num_layers: int) -> str:
    """How one rank's block sits in memory, as the scheduler knows it from the spec.

    Device, attention backend, vLLM's resolved kernel layout (stride order,
    e.g. LBNHC), spec type, KV quantization mode, layers, the per-layer
    block shape (heads, tokens, K and V head sizes) and page bytes (which
    include a backend's padding).
    """
    from vllm.platforms import current_platform

    attn = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    kernel = (getattr(kv_cache_config, "kv_cache_layout", None)
              or getattr(vllm_config.cache_config, "kv_cache_layout", None) or "unresolved")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    mla = getattr(spec, "cache_dtype_str", None)
    skip = getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None)
    options = (f"/mla={mla}" if mla else "") + ("/skip=" + ",".join(skip) if skip else "")
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        # Which layers each stage holds: a rank's part of a slot holds its
        # stage's layers in order, so 1+3 and 3+1 splits of four layers
        # write different layers at the same place.
        from vllm.distributed.utils import get_pp_indices

        total = vllm_config.model_config.get_total_num_hidden_layers()
        options += "/stages=" + ",".join(f"{a}-{b}" for a, b in (get_pp_indices(total, r, pp) for r in range(pp)))
    return (f"{current_platform.device_type}/{getattr(attn, 'name', attn) or 'auto'}/{kernel}/"
            f"{type(spec).__name__}/{quant}{options}/"
            f"{num_layers}x[{spec.num_kv_heads},{spec.block_size},{spec.head_size}+{spec.head_size_v}]"
            f"/page={spec.page_size_bytes}")


def namespace_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KvtierConfig) -> KeyNamespace:
    spec, layers = kv_cache_spec(kv_cache_config)
    pc = vllm_config.parallel_config
    mc = vllm_config.model_config
    return KeyNamespace(model=_model_identity(vllm_config, cfg), dtype=str(spec.dtype),
                        layout=_layout_description(vllm_config, kv_cache_config, spec,
                                                   layers_per_rank(vllm_config, len(layers))),
                        block_tokens=spec.block_size, tp_size=pc.tensor_parallel_size,
                        pp_size=pc.pipeline_parallel_size,
                        cache_dtype=str(vllm_config.cache_config.cache_dtype), model_dtype=str(mc.dtype))


def device_copies_are_async() -> bool:
    """Whether workers copy on a device stream (CUDA) and settle saves after the step (worker.py)."""
    from vllm.platforms import current_platform

    return current_platform.device_type == "cuda"


def defers_saves(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KvtierConfig) -> bool:
    """Whether the workers hold a step's saves until the next step's
    ``handle_preemptions`` (``defer_saves``, on CPU). Only where vLLM calls
    that hook before it writes any KV of the step: its model runner V2
    zeroes and copies blocks first, and so does V1 for a KV cache whose new
    blocks must be zeroed (Mamba, mixed precisions)."""
    if not cfg.defer_saves or device_copies_are_async():
        return False
    try:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # noqa: BLE001 - a runner vLLM itself refuses: nothing is deferred
        v2 = True
    if v2 or getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        log.warning("kvtier: defer_saves is off: %s writes KV before handle_preemptions; saves are copied "
                    "within their step", "vLLM's model runner V2" if v2 else "zeroing new KV cache blocks")
        return False
    return True


def saves_settle_later(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KvtierConfig) -> bool:
    """Whether a step's saves may still be copied after the step (device
    copies, or deferred CPU saves): the scheduler then delays the frees of
    finished requests until the workers report their saves done."""
    return device_copies_are_async() or defers_saves(vllm_config, kv_cache_config, cfg)


def build_scheduler_side(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                         cfg: KvtierConfig) -> SchedulerSide:
    spec, layers = kv_cache_spec(kv_cache_config)
    ns = namespace_for(vllm_config, kv_cache_config, cfg)
    pc = vllm_config.parallel_config
    ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
    # Every rank's part of a slot has the same size: that of the largest
    # pipeline stage (the scheduler's config holds stage 0's layers).
    rank_bytes = rank_bytes_for(spec, layers_per_rank(vllm_config, len(layers)))
    engine_id = vllm_config.kv_transfer_config.engine_id or "0"
    # A tier written under another layout (block size, dtype, cache dtype,
    # kernel layout, ranks) starts empty instead of recovering blocks whose
    # bytes this engine would misread.
    store = open_store(cfg, arena_path(cfg.shm_dir, engine_id), rank_bytes, ranks, ns.fingerprint())
    tier, ssd = store.tier, store.ssd
    log.info("kvtier: DRAM tier %s, %d slots of %d bytes (%.2f GiB), block of %d tokens",
             tier.path, tier.num_slots, tier.slot_stride, tier.size_bytes / (1 << 30), spec.block_size)
    if ssd is not None:
        log.info("kvtier: SSD tier on %s: %d slots, %d blocks recovered", ":".join(ssd.paths), ssd.num_slots,
                 store.counters()["ssd_slots_used"])
    return SchedulerSide(EmbeddedPlacement(store), ns, spec.block_size, ranks,
                         promote_timeout_s=cfg.promote_timeout_s,
                         async_saves=saves_settle_later(vllm_config, kv_cache_config, cfg))


def meta_service_url(cfg: KvtierConfig) -> tuple[str, str]:
    """The meta service's URL and token: the connector's own keys, else the
    config files named by ``MMC_LOCAL_CONFIG_PATH`` / ``MMC_META_CONFIG_PATH``
    (what the seeds export before starting vLLM), else loopback defaults."""
    url, token = cfg.meta_service_url, cfg.token or os.environ.get("KVTIER_TOKEN", "")
    if not url or not token:
        from kvtier.pool.config import load_pool_config

        files = load_pool_config()
        url = url or files.client_url
        token = token or (files.token or "")
    return url, token


def build_pool_scheduler_side(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                              cfg: KvtierConfig) -> SchedulerSide | None:
    """The scheduler half on the node's pool; None when the service refuses
    this instance's block geometry (the engine then runs without kvtier)."""
    from kvtier.pool.client import PoolPlacement, PoolRefused, PoolUnavailable
    from kvtier.pool.wire import WireError

    spec, layers = kv_cache_spec(kv_cache_config)
    ns = namespace_for(vllm_config, kv_cache_config, cfg)
    pc = vllm_config.parallel_config
    ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
    rank_bytes = rank_bytes_for(spec, layers_per_rank(vllm_config, len(layers)))
    url, token = meta_service_url(cfg)
    served = vllm_config.model_config.served_model_name
    name = f"{served[0] if isinstance(served, list) else served or 'vllm'}@{os.getpid()}"
    wait = cfg.promote_timeout_s  # the service counts a move as stalled no sooner (wire.Hello)
    try:
        placement = PoolPlacement(url, ranks=ranks, rank_bytes=rank_bytes, name=str(name), token=token,
                                  promote_timeout_s=wait)
    except PoolRefused as err:
        if err.code == "geometry":
            log.error("kvtier: the meta service at %s refused this instance: %s; kvtier is off for it", url,
                      err.message)
            return None
        if not err.transient:  # a token or a version to fix: said before the engine starts
            raise ConfigError("meta_service_url", url, f"the meta service refused this instance: {err.message}",
                              "kv_connector_extra_config") from None
        log.warning("kvtier: the meta service at %s cannot take this instance yet (%s); lookups miss until it "
                    "does", url, err.message)
        placement = PoolPlacement(url, ranks=ranks, rank_bytes=rank_bytes, name=str(name), token=token,
                                  connect=False, promote_timeout_s=wait)
    except (OSError, WireError, PoolUnavailable) as err:
        # Not there yet (started after vLLM, or restarting): lookups miss
        # until it answers; the engine serves meanwhile.
        log.warning("kvtier: the meta service at %s is not reachable (%s); lookups miss until it is", url, err)
        placement = PoolPlacement(url, ranks=ranks, rank_bytes=rank_bytes, name=str(name), token=token,
                                  connect=False, promote_timeout_s=wait)
    else:
        log.info("kvtier: on the node pool at %s (session %d, arena %s, %d slots)", url, placement.session,
                 placement.arena_path, placement.num_slots)
    return SchedulerSide(placement, ns, spec.block_size, ranks, promote_timeout_s=cfg.promote_timeout_s,
                         async_saves=saves_settle_later(vllm_config, kv_cache_config, cfg))


def build_worker_side(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KvtierConfig) -> WorkerSide:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = vllm_config.parallel_config.tensor_parallel_size
    pp_rank = get_pp_group().rank_in_group
    rank = pp_rank * tp + get_tp_group().rank_in_group
    groups = kv_cache_config.kv_cache_groups
    # vLLM's tokens per block: lets the worker recognise blocks split into kernel blocks.
    block_tokens = groups[0].kv_cache_spec.block_size if len(groups) == 1 else None
    # Microbatches (dual-batch overlap) each run a layer's attention and call
    # save_kv_layer in turn: saves are then queued after the whole forward.
    ubatching = bool(getattr(vllm_config.parallel_config, "use_ubatching", False))
    return WorkerSide(rank, kv_cache_config.num_blocks, cfg.verify_checksums, block_tokens=block_tokens,
                      saves_per_layer=not ubatching, warm_interval_s=warm_interval_s(cfg.kv_warm_interval_s),
                      defer_saves=defers_saves(vllm_config, kv_cache_config, cfg))


def worker_rank_bytes(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, pp_rank: int) -> int | None:
    """The ``rank_bytes`` the scheduler gives every rank, worked out from a
    worker's own config (its stage's layers); None when the spec is one the
    scheduler refuses anyway."""
    try:
        spec, layers = kv_cache_spec(kv_cache_config)
    except ConfigError:
        return None
    return rank_bytes_for(spec, layers_per_rank(vllm_config, len(layers), pp_rank))


HOOK_FLUSH_S = 1.0  # the hooks' time goes out with the next statistics, or on its own after this long

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _on_engine_path(hook: _Hook) -> _Hook:
    """Count the wall time of a hook vLLM's engine waits for (the scheduler's
    or a worker's thread): ``kvtier_scheduler_hook_seconds`` and
    ``kvtier_worker_hook_seconds`` are what the cache costs the engine on
    its own path, whatever the cache's threads do beside it. vLLM calls a
    connector's hooks from one thread: the sum takes no lock."""

    @functools.wraps(hook)
    def timed(self: KvtierConnector, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._hook_s += time.perf_counter() - t0

    return timed  # type: ignore[return-value]


class KvtierConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvtier's pool."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        self._hook_s = 0.0  # time in the hooks not yet reported
        self._hook_flushed_at = time.monotonic()
        self._hook_stat = "scheduler_hook_seconds" if role == KVConnectorRole.SCHEDULER else "worker_hook_seconds"
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._inert: str | None = None  # why this run does nothing (scheduler role), or None
        self._worker_rank_bytes: int | None = None  # what the arena gives each rank (worker role)
        try:
            cfg = parse_connector_config(extra, check_memory=False)
            check_vllm_config(vllm_config, cfg)
            if role == KVConnectorRole.SCHEDULER:
                for line in keys_not_used(extra, cfg):  # said once, by the scheduler half
                    log.warning("kvtier: %s", line)
                self._inert = inert_reason(vllm_config, kv_cache_config)
                if self._inert is not None:
                    # Only the scheduler half decides: with no lookups and no
                    # saves planned, workers never copy or attach anything.
                    # (A worker that stood down on its own while the scheduler
                    # planned loads would report them as done: wrong KV.)
                    log.warning("kvtier: off for this run: %s; no lookups, no saves, no arena", self._inert)
                    return
                # An unsupported model is refused before shared memory is touched.
                kv_cache_spec(kv_cache_config)
                if cfg.backend.shared:
                    self._scheduler = build_pool_scheduler_side(vllm_config, kv_cache_config, cfg)
                    if self._scheduler is None:
                        self._inert = "the meta service refused this instance"
                    return
                # Arenas of killed engines go first: on huge pages they hold
                # exactly the pages this start needs.
                removed = remove_stale_arenas(cfg.shm_dir)
                if removed:
                    log.info("kvtier: removed %d arenas left by dead processes", len(removed))
                check_dram_fits(cfg)
                # Opening the tiers can refuse a path (mounted, held, no direct
                # I/O): that is a configuration error too, shown as one line.
                self._scheduler = build_scheduler_side(vllm_config, kv_cache_config, cfg)
            else:
                self._worker = build_worker_side(vllm_config, kv_cache_config, cfg)
                pp_rank = self._worker.rank // vllm_config.parallel_config.tensor_parallel_size
                self._worker_rank_bytes = worker_rank_bytes(vllm_config, kv_cache_config, pp_rank)
        except ConfigError as err:
            log.error("%s", err)
            raise

    @property
    def requires_kv_delivery(self) -> bool:
        # vLLM asks this to choose how a request preempted with a step in
        # flight (asynchronous scheduling) is handled: True drops that
        # step's output, which is sampled again. kvtier's saves need no such
        # care (a dropped save is a future miss), but its loads do: vLLM
        # checks a failed load's blocks only against running requests, so
        # the token a preempted request's step sampled on a bad block would
        # otherwise be delivered (tests/unit/test_vllm_scheduler.py).
        return True

    # --- scheduler side ---------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    @_on_engine_path
    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.on_new_request(request)
            except Exception:  # noqa: BLE001 - keys are computed again at lookup
                log.exception("kvtier: hashing a new request failed")

    @_on_engine_path
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            assert self._inert is not None, "scheduler hook called on a worker"
            return 0, False
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - a lookup failure is a miss
            log.exception("kvtier: lookup failed; treating as a miss")
            return 0, False

    # Every hook below catches what the cache throws: the engine must never
    # fail because of the cache. Where vLLM already counts on a load, a
    # failure becomes load errors (vLLM recomputes); elsewhere it is a miss.

    @_on_engine_path
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is None:
            assert self._inert is not None, "scheduler hook called on a worker"
            return
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: planning a load failed; its blocks will be recomputed")
            self._scheduler.fail_load(request, blocks, num_external_tokens)

    @_on_engine_path
    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        if self._scheduler is None:
            assert self._inert is not None, "scheduler hook called on a worker"
            return StepPlan(step=0, arena="")  # nothing to load or save: workers do nothing with it
        try:
            return self._scheduler.build_connector_meta(scheduler_output)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: planning step copies failed; this step loads nothing and saves nothing")
            return self._scheduler.failed_step_plan()

    @_on_engine_path
    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.update_connector_output(connector_output)
            except Exception:  # noqa: BLE001
                log.exception("kvtier: processing the workers' report failed")

    @_on_engine_path
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        if self._scheduler is None:
            assert self._inert is not None, "scheduler hook called on a worker"
            return {}
        try:
            return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: splitting hits by source failed")
            return super().get_external_cache_hit_sources(request, num_external_tokens)

    @_on_engine_path
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            assert self._inert is not None, "scheduler hook called on a worker"
            return False, None
        try:
            return self._scheduler.request_finished(request, block_ids)
        except Exception:  # noqa: BLE001
            log.exception("kvtier: request_finished failed")
            return False, None

    def reset_cache(self) -> bool | None:
        if self._scheduler is None:
            return None
        try:
            # New key seed and store entries doomed: nothing from before the
            # reset matches after it (SchedulerSide.reset_cache).
            n = self._scheduler.reset_cache()
        except Exception:  # noqa: BLE001
            log.exception("kvtier: reset failed")
            return False
        log.info("kvtier: reset: %d blocks dropped or made unreadable; keys from now on use a new seed", n)
        return True

    # --- worker side ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        try:
            self._worker.register_kv_caches(kv_caches)
        except Exception:  # noqa: BLE001 - the engine serves without the cache rather than not at all
            log.exception("kvtier: reading vLLM's KV tensors failed; this worker stays inert")
            self._worker.layout = None
        layout = self._worker.layout
        if layout is None:
            return  # inert (said once by the worker): loads fail over to recompute, nothing is saved
        if self._worker_rank_bytes is not None and layout.block_bytes > self._worker_rank_bytes:
            # Checked here, at start-up, rather than when the first plan
            # names the arena: a rank that does not fit would otherwise find
            # out while serving.
            pp = self._vllm_config.parallel_config.pipeline_parallel_size
            err = ConfigError("pipeline_parallel_size", pp,
                              f"worker rank {self._worker.rank} holds {len(layout.layer_names)} layers "
                              f"({layout.block_bytes} bytes per block), more than the "
                              f"{self._worker_rank_bytes} bytes per rank the DRAM arena is sized for", "vLLM")
            log.error("%s", err)
            raise err

    @_on_engine_path
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # vLLM's first call of a step, before it writes any KV (block
        # zeroing, loads, the forward pass): deferred CPU saves of the steps
        # before are copied now, while their blocks still hold what was computed.
        if self._worker is None:
            return
        try:
            self._worker.copy_deferred_saves()
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("kvtier: copying the deferred saves failed; they are not kept")
            self._worker.fail_deferred_saves()

    @_on_engine_path
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        try:
            self._worker.start_load_kv(plan)
        except ConfigError:
            raise  # an arena this worker does not fit: a broken set-up, not a miss
        except Exception:  # noqa: BLE001
            log.exception("kvtier: loading failed; vLLM recomputes the step's %d blocks", len(plan.loads))
            self._worker.fail_loads(plan)

    @_on_engine_path
    def wait_for_layer_load(self, layer_name: str) -> None:
        # CPU: loads completed in start_load_kv. CUDA: vLLM's stream waits
        # for this layer's copies (the host does not).
        assert self._worker is not None
        try:
            self._worker.wait_for_layer_load(layer_name)
        except Exception:  # noqa: BLE001 - an error here is a copy that failed: never a crash
            log.exception("kvtier: waiting for the loads of %s failed; the step's loads are recomputed",
                          layer_name)
            if self.has_connector_metadata():  # else no plan, so nothing was loaded
                self._worker.fail_loads(self._get_connector_metadata())

    @_on_engine_path
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # CPU: saves happen for all layers at once in wait_for_save. CUDA:
        # this layer's copies are queued now, behind the attention that wrote it.
        assert self._worker is not None
        plan = self._get_connector_metadata()
        try:
            self._worker.save_kv_layer(layer_name, plan)
        except Exception:  # noqa: BLE001 - the rest of the layers are queued in wait_for_save, or fail there
            log.exception("kvtier: queueing the saves of %s failed", layer_name)

    @_on_engine_path
    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            plan = self._get_connector_metadata()
            assert isinstance(plan, StepPlan)
            try:
                self._worker.wait_for_save(plan)
            except ConfigError:
                raise  # an arena this worker does not fit: a broken set-up, not a miss
            except Exception:  # noqa: BLE001
                log.exception("kvtier: saving failed; the step's %d blocks are not kept", len(plan.saves))
                self._worker.fail_saves(plan)

    @_on_engine_path
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        try:
            return self._worker.get_block_ids_with_load_errors()
        except Exception:  # noqa: BLE001 - in doubt, every block the step loaded is recomputed
            log.exception("kvtier: collecting load errors failed; the step's loads count as failed")
            return set(self._worker.step_load_block_ids)

    @_on_engine_path
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Only requests the scheduler delayed (device copies, deferred CPU
        # saves) are reported; vLLM frees their blocks then.
        if self._worker is None:
            return None, None
        try:
            return self._worker.get_finished(), None
        except Exception:  # noqa: BLE001
            # Freed now rather than never: vLLM's stream already waits for
            # every queued copy before it can write those blocks again, and
            # deferred CPU saves are copied before the next step writes any.
            log.exception("kvtier: checking finished saves failed; delayed frees go ahead")
            return self._worker.release_delayed() or None, None

    @_on_engine_path
    def build_connector_worker_meta(self) -> Any:
        if self._worker is None:
            return None
        try:
            return self._worker.build_report()
        except Exception:  # noqa: BLE001 - a lost report is settled by a later one; slots left unsealed are misses
            log.exception("kvtier: building the step's report failed")
            return None

    # --- both -------------------------------------------------------------

    @_on_engine_path
    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The half's statistics with the hooks' time, or None when there is
        nothing to report yet. An inert connector reports nothing."""
        half = self._scheduler or self._worker
        if half is None:
            return None
        try:
            stats = half.get_kv_connector_stats()
        except Exception:  # noqa: BLE001 - statistics are never worth a failed step
            log.exception("kvtier: collecting statistics failed")
            stats = None
        # The hooks' time rides along with the half's statistics, or goes
        # out alone at most every HOOK_FLUSH_S (not a report every step).
        now = time.monotonic()
        if self._hook_s and (stats is not None or now - self._hook_flushed_at >= HOOK_FLUSH_S):
            stats = stats if stats is not None else KvtierStats()
            stats.add(self._hook_stat, self._hook_s)
            self._hook_s, self._hook_flushed_at = 0.0, now
        return stats

    def shutdown(self) -> None:
        half = self._scheduler or self._worker
        if half is not None:
            try:
                half.shutdown()
            except Exception:  # noqa: BLE001 - vLLM's own shutdown goes on (a device error, a pool gone)
                log.exception("kvtier: shutting down failed")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: on an accelerator the loads run on a stream of kvtier's and
        vLLM's stream waits for each layer's in ``wait_for_layer_load``
        (and saves start in ``save_kv_layer``), Python calls between the
        layers that a full CUDA graph's replay skips; the forward would then
        read blocks still being copied. vLLM switches to piecewise graphs."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
