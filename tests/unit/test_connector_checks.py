"""What the connector refuses at start-up, and when it stays inert (issue 7, items 2, 3, 5, 12, 13).

Refused: decode or prefill context parallelism, a load-failure policy other
than ``recompute``, data parallelism with an SSD tier, sliding-window and
chunked-local attention, and any spec that is not exactly full attention or
MLA. Inert (one log line, no lookups, no saves, no arena): runs in which vLLM
itself has prefix caching off, non-causal attention, R-SWA.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.config import parse_connector_config
from kvtier.connector.connector import (
    KvtierConnector,
    check_vllm_config,
    inert_reason,
    kv_cache_spec,
    layers_per_rank,
    rank_bytes_for,
    worker_rank_bytes,
)
from kvtier.connector.meta import StepPlan
from kvtier.errors import ConfigError
from tests.unit.vllm_configs import (
    BLOCK,
    HEAD_SIZE,
    HEADS,
    full_spec,
    kv_cache_config,
    shm_names,
    vllm_config,
)

DRAM_ONLY = parse_connector_config({"dram_size": "8MB"}, check_memory=False)
WITH_SSD = parse_connector_config({"dram_size": "8MB", "ssd_path": "/tmp/kvtier-ssd.bin"}, check_memory=False)


# --- context parallelism (item 2) ------------------------------------------------


def test_decode_context_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        # (vLLM itself wants the TP size divisible by the DCP size.)
        check_vllm_config(vllm_config(parallel={"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
                          DRAM_ONLY)
    assert str(err.value) == (
        "kvtier config error: vLLM: decode_context_parallel_size = 2: kvtier does not support decode context "
        "parallelism; run without --decode-context-parallel-size (-dcp)")


def test_prefill_context_parallelism_is_refused() -> None:
    cfg = SimpleNamespace(**vars(vllm_config()))
    cfg.parallel_config = SimpleNamespace(**{**vars(vllm_config().parallel_config),
                                             "prefill_context_parallel_size": 2})
    with pytest.raises(ConfigError) as err:
        check_vllm_config(cfg, DRAM_ONLY)
    assert err.value.key == "prefill_context_parallel_size" and err.value.value == 2
    assert "--prefill-context-parallel-size" in str(err.value)


def test_plain_parallel_config_passes() -> None:
    check_vllm_config(vllm_config(), DRAM_ONLY)
    check_vllm_config(vllm_config(), WITH_SSD)


# --- kv_load_failure_policy (item 5) ----------------------------------------------


def test_vllms_default_failure_policy_is_refused_with_what_to_set() -> None:
    from vllm.config import KVTransferConfig

    assert KVTransferConfig().kv_load_failure_policy == "fail"  # vLLM's default: what a new user gets
    with pytest.raises(ConfigError) as err:
        check_vllm_config(vllm_config(policy="fail"), DRAM_ONLY)
    assert err.value.key == "kv_load_failure_policy" and err.value.value == "fail"
    assert '"kv_load_failure_policy": "recompute"' in str(err.value)


# --- data parallelism with an SSD tier (item 13) ------------------------------------


@pytest.mark.parametrize("how", [
    {"parallel": {"data_parallel_size": 2}},  # MoE: the size is kept
    {"engine_id": "abc_dp0"},  # non-MoE rank 0: size reset to 1, only the engine id says DP
    {"engine_id": "abc_dp1"},
])
def test_data_parallelism_with_an_ssd_tier_is_refused(how: dict) -> None:
    with pytest.raises(ConfigError) as err:
        check_vllm_config(vllm_config(**how), WITH_SSD)
    assert err.value.key == "ssd_path" and err.value.value == "/tmp/kvtier-ssd.bin"
    assert "its own ssd_path" in str(err.value) and "backend: pool" in str(err.value)


def test_data_parallelism_without_ssd_is_accepted() -> None:
    check_vllm_config(vllm_config(parallel={"data_parallel_size": 2}, engine_id="abc_dp1"), DRAM_ONLY)


def test_a_dp_index_above_zero_alone_is_data_parallelism() -> None:
    cfg = vllm_config()
    cfg.parallel_config = SimpleNamespace(**{**vars(cfg.parallel_config), "data_parallel_index": 1})
    with pytest.raises(ConfigError):
        check_vllm_config(cfg, WITH_SSD)


# --- specs refused, specs accepted, runs inert (item 3) -------------------------------


@pytest.mark.parametrize("spec", [
    full_spec(sliding_window=128),
    full_spec(attention_chunk_size=256),
    SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=full_spec().dtype,
                      sliding_window=128),
    ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                              dtype=full_spec().dtype, attention_chunk_size=256),
], ids=["full-with-window", "full-with-chunks", "sliding-window", "chunked-local"])
def test_sliding_window_and_chunked_local_models_are_refused(spec) -> None:
    with pytest.raises(ConfigError) as err:
        kv_cache_spec(kv_cache_config(spec))
    assert err.value.key == "kv_cache_spec" and err.value.value == type(spec).__name__
    # The window's own reason, before the check of the spec's type: that
    # check alone would refuse the last two for being other classes, and
    # the first two not at all.
    assert "no sliding window or chunked local attention" in str(err.value)


def test_a_subclass_of_full_attention_is_refused() -> None:
    spec = SinkFullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                 dtype=full_spec().dtype, sink_len=4)
    with pytest.raises(ConfigError) as err:
        kv_cache_spec(kv_cache_config(spec))
    assert err.value.value == "SinkFullAttentionSpec"
    assert "exactly FullAttentionSpec or MLAAttentionSpec" in str(err.value)


def test_two_kv_cache_groups_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        kv_cache_spec(kv_cache_config(groups=2))
    assert err.value.key == "kv_cache_groups" and err.value.value == 2


def test_full_attention_and_mla_are_accepted() -> None:
    spec, layers = kv_cache_spec(kv_cache_config())
    assert type(spec).__name__ == "FullAttentionSpec" and len(layers) == 4
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=full_spec().dtype)
    assert kv_cache_spec(kv_cache_config(mla))[0] is mla


def test_runs_with_prefix_caching_on_and_a_causal_full_attention_model_are_not_inert() -> None:
    assert inert_reason(vllm_config(), kv_cache_config()) is None


def test_prefix_caching_off_makes_the_connector_inert() -> None:
    reason = inert_reason(vllm_config(cache={"enable_prefix_caching": False}), kv_cache_config())
    assert reason == "vLLM runs with prefix caching off (cache_config.enable_prefix_caching is False)"


def test_non_causal_attention_makes_the_connector_inert_even_if_prefix_caching_looks_on() -> None:
    # The engine core turns prefix caching off for non-causal specs; the spec
    # is checked too, so the answer does not depend on which copy of the
    # config the connector was given.
    reason = inert_reason(vllm_config(), kv_cache_config(full_spec(non_causal=True)))
    assert reason is not None and "non-causal" in reason


def test_rswa_makes_the_connector_inert() -> None:
    spec = RSWASpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=full_spec().dtype,
                    rswa_window=64)
    reason = inert_reason(vllm_config(), kv_cache_config(spec))
    assert reason is not None and "RSWASpec" in reason


@pytest.fixture
def shm_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


@pytest.fixture
def kvtier_log():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("kvtier")
    handler = Keep(logging.DEBUG)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


class _Request:
    request_id = "r"
    num_tokens = 10 * BLOCK + 1
    all_token_ids = list(range(10 * BLOCK + 1))
    num_computed_tokens = 0


def test_an_inert_connector_does_nothing_and_says_so_once(shm_dir, kvtier_log) -> None:
    # A stale arena sits in shm_dir: an inert connector does not even clean up.
    stale = os.path.join(shm_dir, "kvtier-dram-999999999-old")
    open(stale, "wb").close()
    cfg = vllm_config(extra={"dram_size": "8MB", "shm_dir": shm_dir}, cache={"enable_prefix_caching": False})
    conn = KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert conn._scheduler is None
    lines = [r.getMessage() for r in kvtier_log if r.levelno >= logging.INFO]
    assert lines == ["kvtier: off for this run: vLLM runs with prefix caching off "
                     "(cache_config.enable_prefix_caching is False); no lookups, no saves, no arena"]
    req = _Request()
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, None, 0)
    plan = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": req.num_tokens}))
    assert isinstance(plan, StepPlan) and plan.loads == [] and plan.saves == []
    assert conn.get_external_cache_hit_sources(req, 0) == {}
    assert conn.request_finished(req, [1, 2]) == (False, None)
    assert conn.get_kv_connector_stats() is None
    conn.shutdown()
    assert shm_names(shm_dir) == ["kvtier-dram-999999999-old"]  # no arena made, none removed


def test_store_keys_an_instance_of_a_shared_pool_does_not_use_are_said_once(shm_dir, kvtier_log) -> None:
    """An instance moved from backend embedded to the node's pool with its
    ssd_path left in: a warning a key says the meta service's files decide
    (prefix caching off keeps the test off any service)."""
    extra = {"backend": "pool", "ssd_path": "/tmp/kvtier-not-used.img", "shm_dir": shm_dir}
    cfg = vllm_config(extra=extra, cache={"enable_prefix_caching": False})
    KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config()).shutdown()
    lines = [r.getMessage() for r in kvtier_log if r.levelno >= logging.WARNING]
    assert lines[:2] == [
        "kvtier: 'ssd_path' is not used with backend pool: the meta service sizes and runs the pool from its own "
        "config files (there: ubsio.disk.path)",
        "kvtier: 'shm_dir' is not used with backend pool: the meta service sizes and runs the pool from its own "
        "config files (there: kvtier.shm_dir)"]
    assert sum("is not used with backend" in line for line in lines) == 2


def test_a_refused_spec_stops_start_up_before_any_arena_is_made(shm_dir) -> None:
    cfg = vllm_config(extra={"dram_size": "8MB", "shm_dir": shm_dir})
    with pytest.raises(ConfigError):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(full_spec(sliding_window=64)))
    assert shm_names(shm_dir) == []


def test_a_refused_failure_policy_stops_start_up_in_either_role(shm_dir) -> None:
    cfg = vllm_config(extra={"dram_size": "8MB", "shm_dir": shm_dir}, policy="fail")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as err:
            KvtierConnector(cfg, role, kv_cache_config())
        assert err.value.key == "kv_load_failure_policy"
    assert shm_names(shm_dir) == []


# --- pipeline parallelism with uneven stages (item 12) --------------------------------


def _pp(total: int, pp: int):
    cfg = vllm_config(parallel={"pipeline_parallel_size": pp},
                      model_kw={"get_total_num_hidden_layers": lambda: total})
    return cfg


def test_uneven_stages_are_sized_for_the_largest(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    cfg = _pp(30, 4)  # vLLM splits 30 layers over 4 stages as 7/8/8/7
    assert layers_per_rank(cfg, 7, pp_rank=0) == 8
    assert layers_per_rank(cfg, 8, pp_rank=1) == 8
    assert layers_per_rank(cfg, 7, pp_rank=3) == 8
    assert layers_per_rank(_pp(30, 1), 30) == 30


def test_a_user_partition_is_honoured(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,12,10,4")
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    assert layers_per_rank(_pp(30, 4), 4, pp_rank=0) == 12


def test_every_worker_of_an_uneven_pipeline_fits_the_scheduler_s_arena(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    cfg = _pp(30, 4)
    spec = full_spec()
    scheduler = rank_bytes_for(spec, layers_per_rank(cfg, 7, 0))  # the scheduler's config: stage 0
    for pp_rank, n in enumerate((7, 8, 8, 7)):
        assert worker_rank_bytes(cfg, kv_cache_config(spec, layers=n), pp_rank) == scheduler
        assert rank_bytes_for(spec, n) <= scheduler
    assert scheduler == 8 * spec.page_size_bytes  # the page (2 heads x 16 x 16 floats) is 64-byte aligned


def test_a_worker_that_does_not_fit_the_arena_fails_instead_of_switching_off(make_tier, capacity_for) -> None:
    import torch

    from kvtier.connector.worker import WorkerSide

    page = HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one layer's block, float32
    tier = make_tier(capacity_for(4, 7 * page), 7 * page)  # sized for a stage of 7 layers
    w = WorkerSide(rank=0, num_blocks=16)
    w.register_kv_caches({f"l{i}": torch.zeros(16, HEADS, BLOCK, 2 * HEAD_SIZE) for i in range(8)})
    plan = StepPlan(step=0, arena=tier.path, saves=[])
    with pytest.raises(ConfigError) as err:
        w._attach(plan.arena)
    assert err.value.key == "dram arena" and err.value.value == tier.path
    assert f"holds {7 * page} bytes per block" in str(err.value)
    assert f"needs {8 * page} bytes" in str(err.value)


def _stage_tensors(n: int) -> dict:
    import torch

    return {f"model.layers.{i}.attn": torch.zeros(64, HEADS, BLOCK, 2 * HEAD_SIZE) for i in range(n)}


@pytest.fixture
def worker_at_pp_rank_1(monkeypatch):
    """KvtierConnector in the worker role, as pipeline rank 1 of 4 (vLLM's process groups stubbed)."""
    import kvtier.connector.connector as connector
    from kvtier.connector.worker import WorkerSide

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    monkeypatch.setattr(connector, "build_worker_side", lambda vc, kc, cfg: WorkerSide(1, kc.num_blocks))
    return lambda: KvtierConnector(_pp(30, 4), KVConnectorRole.WORKER, kv_cache_config(layers=8))


def test_a_middle_stage_fits_the_arena_sized_for_the_largest_stage(worker_at_pp_rank_1) -> None:
    conn = worker_at_pp_rank_1()
    conn.register_kv_caches(_stage_tensors(8))  # 8 layers where stage 0 has 7: fits
    assert conn._worker.layout.block_bytes == 8 * full_spec().page_size_bytes


def test_a_worker_layout_larger_than_the_arena_fails_at_start_up(worker_at_pp_rank_1) -> None:
    conn = worker_at_pp_rank_1()
    with pytest.raises(ConfigError) as err:
        conn.register_kv_caches(_stage_tensors(9))  # a layer the spec did not announce
    page = full_spec().page_size_bytes
    assert str(err.value) == (
        f"kvtier config error: vLLM: pipeline_parallel_size = 4: worker rank 1 holds 9 layers ({9 * page} "
        f"bytes per block), more than the {8 * page} bytes per rank the DRAM arena is sized for")


def test_an_arena_the_worker_does_not_fit_stops_the_step_instead_of_becoming_misses(
        worker_at_pp_rank_1, make_tier, capacity_for) -> None:
    from kvtier.connector.meta import BlockCopy

    conn = worker_at_pp_rank_1()
    conn.register_kv_caches(_stage_tensors(8))
    page = full_spec().page_size_bytes
    tier = make_tier(capacity_for(4, 7 * page, 4), 7 * page, 4)  # an arena sized from stage 0 alone
    conn.bind_connector_metadata(StepPlan(step=0, arena=tier.path, saves=[BlockCopy(1, 0, b"k" * 16)]))
    conn.start_load_kv(None)
    with pytest.raises(ConfigError) as err:
        conn.wait_for_save()
    assert err.value.key == "dram arena"


def test_kv_tensors_kvtier_cannot_read_leave_the_engine_serving(worker_at_pp_rank_1) -> None:
    # Before: register_kv_caches raised "has no dimension of 64 blocks" and
    # vLLM's start-up failed; now the worker stays inert and says so once.
    import torch

    conn = worker_at_pp_rank_1()
    conn.register_kv_caches({f"model.layers.{i}.attn": torch.zeros(96, HEADS, BLOCK, 2 * HEAD_SIZE)
                             for i in range(8)})
    assert conn._worker.layout is None and conn._worker.inert_reason
    conn.bind_connector_metadata(StepPlan(step=0, arena="/nonexistent", loads=[], saves=[]))
    conn.start_load_kv(None)
    conn.wait_for_layer_load("model.layers.0.attn")
    conn.save_kv_layer("model.layers.0.attn", None, None)
    conn.wait_for_save()
    assert conn.get_finished(set()) == (None, None)


def test_vllm_is_told_to_keep_python_between_layers_in_cuda_graphs() -> None:
    # vLLM asks the connector class it resolves from the transfer config;
    # True makes it replace full CUDA graphs with piecewise ones, so that
    # wait_for_layer_load and save_kv_layer run at every layer.
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.connector",
                           kv_role="kv_both", kv_connector_extra_config={"backend": "embedded"})
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls.requires_piecewise_for_cudagraph(cfg.kv_connector_extra_config) is True
