"""vLLM configuration objects for connector unit tests, without a model.

vLLM's KV cache spec and cache config classes are plain dataclasses and are
used as they are; ``VllmConfig`` and ``ModelConfig`` load a model when built,
so the connector sees a ``SimpleNamespace`` with the fields it reads instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BLOCK = 16
HEADS = 2
HEAD_SIZE = 8
LAYERS = 4


def full_spec(**kw: Any) -> FullAttentionSpec:
    args = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    args.update(kw)
    return FullAttentionSpec(**args)


def kv_cache_config(spec: Any = None, layers: int = LAYERS, groups: int = 1,
                    kernel_layout: str | None = "LBHNC") -> KVCacheConfig:
    spec = spec if spec is not None else full_spec()
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{g}.{i}.attn" for i in range(layers)], spec)
                         for g in range(groups)],
        kv_cache_layout=kernel_layout)


def make_model_dir(root: Path, name: str = "model", config: dict | None = None,
                   weights: bytes | None = None) -> str:
    """A local model directory: config.json and one weight file of 4 MiB (bytes as given, else a pattern)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or {"hidden_size": 64, "num_hidden_layers": LAYERS}))
    (d / "model.safetensors").write_bytes(weights if weights is not None else bytes(range(256)) * (1 << 14))
    return str(d)


def vllm_config(model: str = "/nonexistent/model", *, extra: dict | None = None, policy: str = "recompute",
                parallel: dict | None = None, cache: dict | None = None, model_kw: dict | None = None,
                engine_id: str = "test-engine", download_dir: str | None = None,
                load_kw: dict | None = None, attention: dict | None = None,
                speculative: dict | None = None) -> SimpleNamespace:
    """What KvtierConnector and its build functions read of vLLM's config."""
    model_args = dict(model=model, revision=None, code_revision=None, quantization=None, hf_overrides={},
                      dtype=torch.float32, get_total_num_hidden_layers=lambda: LAYERS)
    model_args.update(model_kw or {})
    return SimpleNamespace(
        model_config=SimpleNamespace(**model_args),
        parallel_config=ParallelConfig(**(parallel or {})),
        cache_config=CacheConfig(**(cache or {})),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.connector", kv_role="kv_both",
            kv_load_failure_policy=policy, engine_id=engine_id,
            kv_connector_extra_config=dict(extra or {"dram_size": "8MB"})),
        attention_config=SimpleNamespace(**{"backend": None, **(attention or {})}),
        load_config=SimpleNamespace(download_dir=download_dir, **(load_kw or {})),
        speculative_config=SimpleNamespace(**speculative) if speculative else None,
    )


def hf_cache(root: Path, repo: str, commit: str, config: dict | None = None, ref: str = "main") -> str:
    """A Hugging Face hub cache holding ``repo`` at ``commit`` (refs/<ref> -> snapshot), as vLLM leaves it."""
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / ref).write_text(commit)
    make_model_dir(base / "snapshots", commit, config)
    return str(root)


def shm_names(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("kvtier-dram-"))
