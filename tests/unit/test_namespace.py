"""The key namespace names everything that changes a block's bytes (issue 7, item 4).

Model identity (config, sampled weights, quantization, HF overrides, hub
commit, ``model_id``), the dtype the model computes in, vLLM's cache dtype
string (every fp8 and fp4 variant is stored as uint8), the layout (with its
16-byte fingerprint for the SSD superblock), and per request the LoRA
adapter's path and files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.lora.request import LoRARequest

from kvtier.config import parse_connector_config
from kvtier.connector.connector import namespace_for
from kvtier.connector.scheduler import SchedulerSide
from kvtier.keys import KeyNamespace, block_keys
from kvtier.store import TieredStore
from tests.unit.vllm_configs import (
    BLOCK,
    full_spec,
    hf_cache,
    kv_cache_config,
    make_model_dir,
    vllm_config,
)

CFG = parse_connector_config({"dram_size": "8MB"}, check_memory=False)
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def ns(model: str = "/nonexistent", spec=None, cfg=CFG, kv=None, **kw) -> KeyNamespace:
    return namespace_for(vllm_config(model, **kw), kv or kv_cache_config(spec), cfg)


# --- model identity -------------------------------------------------------------------


def test_the_same_local_model_gives_the_same_namespace(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    assert ns(model) == ns(model)
    assert ns(model).seed() == ns(model).seed()


def test_a_changed_config_changes_the_keys(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    before = ns(model).seed()
    make_model_dir(tmp_path, config={"hidden_size": 64, "num_hidden_layers": 4, "rope_theta": 5e5})
    assert ns(model).seed() != before


def test_changed_weights_under_the_same_path_and_config_change_the_keys(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    before = ns(model).seed()
    weights = Path(model) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a fine-tune: same size, same config, other bytes where sampled
    weights.write_bytes(bytes(data))
    assert ns(model).seed() != before


def test_quantization_changes_the_keys(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    assert ns(model).seed() != ns(model, model_kw={"quantization": "fp8"}).seed()


def test_hf_overrides_change_the_keys_and_a_callable_one_is_named_by_its_code(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    plain = ns(model)
    rope = ns(model, model_kw={"hf_overrides": {"rope_theta": 1e6}})
    assert plain.seed() != rope.seed()
    assert rope == ns(model, model_kw={"hf_overrides": {"rope_theta": 1e6}})

    def override(config):
        return config

    by_callable = ns(model, model_kw={"hf_overrides": override})
    assert by_callable.seed() not in (plain.seed(), rope.seed())
    assert "0x" not in by_callable.model  # no address: the same function gives the same key in every process
    assert by_callable == ns(model, model_kw={"hf_overrides": override})


@pytest.mark.parametrize("setting", [
    {"model_kw": {"original_max_model_len": 4096}},  # LongRoPE picks its rope factors by it
    {"model_kw": {"quantization_config": {"ignore": ["lm_head"]}}},
    {"model_kw": {"hf_config_path": "/elsewhere/config"}},
    {"model_kw": {"config_format": "mistral"}},
    {"model_kw": {"model_impl": "transformers"}},
    {"model_kw": {"model_class_overrides": {"LlamaForCausalLM": "my.Model"}}},
    {"load_kw": {"load_format": "tensorizer", "model_loader_extra_config": {"tensorizer_uri": "s3://x"}}},
    {"attention": {"flash_attn_version": 3}},
    {"speculative": {"method": "eagle", "model": "org/draft"}},
])
def test_settings_that_change_the_numerics_change_the_keys(tmp_path: Path, setting: dict) -> None:
    model = make_model_dir(tmp_path)
    assert ns(model, **setting).seed() != ns(model).seed()
    assert ns(model, **setting) == ns(model, **setting)


def test_the_model_length_is_the_one_asked_for_not_the_one_memory_left(tmp_path: Path) -> None:
    """With --max-model-len auto vLLM shrinks max_model_len in place to fit
    the free memory, after the model was built: two identical instances (or
    one after a restart) must keep one namespace."""
    model = make_model_dir(tmp_path)
    a = ns(model, model_kw={"original_max_model_len": -1, "max_model_len": 30000})
    b = ns(model, model_kw={"original_max_model_len": -1, "max_model_len": 28000})
    assert a.seed() == b.seed()
    assert a.seed() != ns(model, model_kw={"original_max_model_len": 8192, "max_model_len": 8192}).seed()


def test_random_weights_share_no_block_with_the_model_or_another_run(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    dummy = ns(model, load_kw={"load_format": "dummy"})
    assert dummy.seed() != ns(model).seed()
    assert dummy.seed() != ns(model, load_kw={"load_format": "dummy"}).seed()


def test_every_json_file_beside_the_weights_is_part_of_the_model(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    before = ns(model).seed()
    (Path(model) / "quantize_config.json").write_text('{"bits": 4, "group_size": 128}')
    assert ns(model).seed() != before


def test_the_vllm_and_torch_versions_are_part_of_the_model(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    model = make_model_dir(tmp_path)
    before = ns(model).seed()
    monkeypatch.setattr(vllm, "__version__", vllm.__version__ + ".post1")
    assert ns(model).seed() != before


def test_pipeline_stages_splitting_the_layers_differently_never_meet(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import envs

    model = make_model_dir(tmp_path)

    def stages(split: str) -> KeyNamespace:
        # The scheduler's KV cache config holds stage 0's layers.
        monkeypatch.setattr(envs, "VLLM_PP_LAYER_PARTITION", split)
        return ns(model, kv=kv_cache_config(layers=int(split.split(",")[0])),
                  parallel={"pipeline_parallel_size": 2}, model_kw={"get_total_num_hidden_layers": lambda: 4})

    one_three, three_one = stages("1,3"), stages("3,1")
    assert one_three.seed() != three_one.seed() and one_three.fingerprint() != three_one.fingerprint()
    assert stages("1,3") == one_three


def test_the_model_dtype_changes_the_keys(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    bf16 = ns(model, model_kw={"dtype": torch.bfloat16})
    fp16 = ns(model, model_kw={"dtype": torch.float16})
    assert bf16.model_dtype == "torch.bfloat16" and bf16.seed() != fp16.seed()


def test_model_id_replaces_the_path_and_digests(tmp_path: Path) -> None:
    a = make_model_dir(tmp_path, "a")
    b = make_model_dir(tmp_path, "b", weights=b"other weights" * 1000)
    cfg = parse_connector_config({"dram_size": "8MB", "model_id": "llama-3-8b@v1"}, check_memory=False)
    assert ns(a, cfg=cfg) == ns(b, cfg=cfg)  # one pool across paths, as the operator asked
    assert ns(a, cfg=cfg).model.startswith("llama-3-8b@v1|")
    assert ns(a).seed() != ns(b).seed() != ns(a, cfg=cfg).seed()
    # ... and quantization still separates what model_id joins.
    assert ns(a, cfg=cfg).seed() != ns(a, cfg=cfg, model_kw={"quantization": "awq"}).seed()


def test_a_hub_model_is_pinned_to_the_commit_in_the_cache(tmp_path: Path) -> None:
    cache = hf_cache(tmp_path / "hub", "org/model", COMMIT_A)
    first = ns("org/model", download_dir=cache)
    assert first.model.startswith(f"org/model@{COMMIT_A}#")
    assert first == ns("org/model", download_dir=cache)  # stable: blocks survive a restart
    hf_cache(tmp_path / "hub", "org/model", COMMIT_B)  # main moved on: other weights
    assert ns("org/model", download_dir=cache).seed() != first.seed()


def test_a_hub_model_given_a_commit_is_pinned_without_a_cache(tmp_path: Path) -> None:
    empty = str(tmp_path / "empty")
    pinned = ns("org/model", download_dir=empty, model_kw={"revision": COMMIT_A})
    assert pinned.model.startswith(f"org/model@{COMMIT_A}|")
    assert pinned == ns("org/model", download_dir=empty, model_kw={"revision": COMMIT_A})


def test_an_unpinned_hub_model_shares_nothing_across_runs(tmp_path: Path) -> None:
    # No snapshot in the cache and a branch name: the weights behind it can
    # change between runs, so each run gets its own namespace.
    empty = str(tmp_path / "empty")
    one = ns("org/model", download_dir=empty, model_kw={"revision": "main"})
    two = ns("org/model", download_dir=empty, model_kw={"revision": "main"})
    assert "#unpinned-" in one.model and one.seed() != two.seed()


# --- bytes: cache dtype, layout -----------------------------------------------------


def test_every_kv_cache_dtype_string_has_its_own_namespace() -> None:
    variants = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "nvfp4"]
    seen = {}
    for name in variants:
        space = ns(spec=full_spec(dtype=torch.uint8), cache={"cache_dtype": name})
        assert space.dtype == "torch.uint8" and space.cache_dtype == name
        seen[space.seed()] = name
    assert len(seen) == len(variants)


def test_the_layout_names_kernel_layout_spec_shape_and_page() -> None:
    space = ns()
    assert space.layout == "cpu/auto/LBHNC/FullAttentionSpec/NONE/4x[2,16,8+8]/page=2048"
    assert space.block_tokens == BLOCK


@pytest.mark.parametrize("change", [
    {"kv": kv_cache_config(kernel_layout="LBNHC")},
    {"kv": kv_cache_config(layers=5)},
    {"spec": full_spec(num_kv_heads=4)},
    {"spec": full_spec(head_size=16)},
    {"spec": full_spec(block_size=32)},
    {"spec": full_spec(dtype=torch.bfloat16)},
    {"spec": full_spec(page_size_padded=4096)},
    {"cache": {"cache_dtype": "fp8_e5m2"}},
    {"parallel": {"pipeline_parallel_size": 2}},
], ids=["kernel-layout", "layers", "heads", "head-size", "block", "dtype", "padding", "cache-dtype", "pp"])
def test_the_fingerprint_follows_the_layout(change: dict) -> None:
    base = ns()
    other = ns(**change)
    assert len(base.fingerprint()) == 16
    assert other.fingerprint() != base.fingerprint()
    assert other.seed() != base.seed()


def test_the_fingerprint_ignores_the_model(tmp_path: Path) -> None:
    a = ns(make_model_dir(tmp_path, "a"))
    b = ns(make_model_dir(tmp_path, "b", weights=b"x" * 4096), model_kw={"quantization": "fp8"})
    assert a.seed() != b.seed()
    assert a.fingerprint() == b.fingerprint()


# --- LoRA: keyed by what the adapter is ---------------------------------------------


@pytest.fixture
def side(make_tier, capacity_for) -> SchedulerSide:
    tier = make_tier(capacity_for(32, 4096), 4096)
    return SchedulerSide(TieredStore(tier), KeyNamespace("m", "torch.float32", "cpu", BLOCK), BLOCK, ranks=1)


class _Req:
    def __init__(self, rid: str, lora: LoRARequest | None) -> None:
        self.request_id = rid
        self.lora_request = lora
        self.all_token_ids = list(range(3 * BLOCK + 1))
        self.num_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def keys_of(side: SchedulerSide, rid: str, lora: LoRARequest | None) -> tuple[bytes, ...]:
    return tuple(side._keys(side._state(_Req(rid, lora)), 3 * BLOCK))


def make_adapter(root: Path, name: str, weights: bytes) -> str:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


def test_an_adapter_is_keyed_by_its_path_not_its_name_or_load_order(side: SchedulerSide,
                                                                     tmp_path: Path) -> None:
    sql = make_adapter(tmp_path, "sql", b"s" * 10000)
    chat = make_adapter(tmp_path, "chat", b"c" * 10000)
    first = keys_of(side, "a", LoRARequest("sql", 1, sql))
    # After a restart the same adapter is loaded under another id and name: same KV, same keys.
    assert keys_of(side, "b", LoRARequest("sql-v1", 7, sql)) == first
    # The id another adapter now has names other KV.
    assert keys_of(side, "c", LoRARequest("sql", 1, chat)) != first
    assert keys_of(side, "d", None) != first


def cacheable(side: SchedulerSide, rid: str, lora: LoRARequest | None) -> bool:
    return not side._state(_Req(rid, lora)).uncacheable


def test_an_adapter_rewritten_in_place_gets_new_keys(side: SchedulerSide, tmp_path: Path) -> None:
    path = make_adapter(tmp_path, "sql", b"s" * 10000)
    before = keys_of(side, "a", LoRARequest("sql", 1, path))
    make_adapter(tmp_path, "sql", b"t" * 10000)  # a new training run written over it
    for name in os.listdir(path):  # written later than the first read, not within the same clock tick
        st = os.stat(os.path.join(path, name))
        os.utime(os.path.join(path, name), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    # Under the same id vLLM may still compute with the weights it loaded
    # first (or with the new ones, once reloaded after an eviction): not cached.
    assert not cacheable(side, "b", LoRARequest("sql", 1, path))
    # Loaded in place: the new weights for sure, under new keys.
    after = keys_of(side, "c", LoRARequest("sql", 1, path, load_inplace=True))
    assert after != before and cacheable(side, "d", LoRARequest("sql", 1, path))
    assert keys_of(side, "e", LoRARequest("sql", 1, path)) == after
    # Another id loads the files as they are now.
    assert keys_of(side, "f", LoRARequest("sql-2", 2, path)) == after


def test_a_hub_adapter_is_pinned_to_its_snapshot_or_to_this_process(side: SchedulerSide, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Not in the cache: this process's own keys, the same for every request of the run.
    a = keys_of(side, "a", LoRARequest("x", 1, "org/adapter-a"))
    assert keys_of(side, "b", LoRARequest("y", 2, "org/adapter-a")) == a
    assert keys_of(side, "c", LoRARequest("x", 1, "org/adapter-b")) != a
    other_run = SchedulerSide(side.store.store, KeyNamespace("m", "torch.float32", "cpu", BLOCK), BLOCK, ranks=1)
    assert keys_of(other_run, "a", LoRARequest("x", 1, "org/adapter-a")) != a  # the hub may have moved on
    # In the cache (an adapter's repository: adapter_config.json, no
    # config.json): pinned to the snapshot, the same in every run.
    repo = tmp_path / "hub" / "models--org--adapter-c"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT_A)
    make_adapter(repo / "snapshots", COMMIT_A, b"a" * 10000)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    pinned = keys_of(side, "d", LoRARequest("x", 3, "org/adapter-c"))
    assert keys_of(other_run, "d", LoRARequest("x", 3, "org/adapter-c")) == pinned


def test_namespaces_are_stable_across_processes(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    child = ("from tests.unit.vllm_configs import vllm_config, kv_cache_config;"
             "from kvtier.config import parse_connector_config;"
             "from kvtier.connector.connector import namespace_for;"
             f"print(namespace_for(vllm_config({model!r}), kv_cache_config(),"
             "parse_connector_config({'dram_size': '8MB'}, check_memory=False)).seed().hex())")
    # One child (it imports vLLM: ~25 s on a small host), under a hash
    # seed other than this process's: str and bytes hash apart in the two.
    hashseed = "0" if os.environ.get("PYTHONHASHSEED") == "4242" else "4242"
    out = subprocess.run([sys.executable, "-c", child], env=dict(os.environ, PYTHONHASHSEED=hashseed),
                         check=True, capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).parents[2]))
    assert out.stdout.strip().splitlines()[-1] == ns(model).seed().hex()


def test_keys_under_two_namespaces_never_meet() -> None:
    a, b = ns(), ns(cache={"cache_dtype": "fp8_e5m2"})
    tokens = list(range(4 * BLOCK))
    assert not set(block_keys(a.seed(), tokens, BLOCK)) & set(block_keys(b.seed(), tokens, BLOCK))
