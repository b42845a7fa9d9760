"""Capacity sizing: ``kvtier size``.

Runs from the command line, before a deployment. KV bytes per token come
either from a model's config.json (2 x layers x KV heads x head size x
dtype bytes, split over tensor-parallel ranks) or from vLLM's own start-up
log lines ("Available KV cache memory: X GiB" per device and "GPU KV cache
size: N tokens" for the instance). From there:

* GB per 1,000 tokens;
* memory per device for a workload = concurrency x mean request length x
  1.5 x KV bytes per token per device (1.5: headroom above the eviction
  watermark);
* host memory for the pool = devices x (DRAM tier + SSD staging memory),
  from flags or from the pool's config files (:func:`pool_totals`);
* huge pages for a size, in units of /proc/meminfo's Hugepagesize;
* the page tables each process mapping the arena needs (1/512 of the
  arena on 4 KiB pages, 1/262,144 on 2 MiB pages).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.pool.config import PoolConfig

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8": 1,
                "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
HEADROOM = 1.5


@dataclass(frozen=True)
class KvShape:
    """KV bytes per token held on one device, and the devices that each hold such a share."""

    bytes_per_token: float
    source: str
    devices: int = 1
    layers: int = 0  # from a model's config (0: not known, from a log)

    @property
    def instance_bytes_per_token(self) -> float:
        return self.bytes_per_token * self.devices

    @property
    def gb_per_1k_tokens(self) -> float:
        return self.bytes_per_token * 1000 / 1e9

    @property
    def gib_per_1k_tokens(self) -> float:
        return self.bytes_per_token * 1000 / (1 << 30)


def from_model_dir(model_dir: str, dtype: str | None = None, tp: int = 1) -> KvShape:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError("--model-dir", model_dir, "has no config.json") from None
    except json.JSONDecodeError as err:
        raise ConfigError("--model-dir", path, f"not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--model-dir", path, "config.json is not a JSON object")
    top = cfg
    text_cfg = cfg.get("text_config")
    cfg = text_cfg if isinstance(text_cfg, dict) else cfg  # multimodal configs nest the language model's
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_size = int(cfg.get("head_dim") or cfg["hidden_size"] // heads) if heads > 0 else 0
    except KeyError as err:
        raise ConfigError("--model-dir", path, f"config.json lacks {err.args[0]}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError("--model-dir", path, f"config.json: a layer or head count is not a number ({err})") from None
    for field, value in (("num_hidden_layers", layers), ("num_attention_heads", heads),
                         ("num_key_value_heads", kv_heads), ("head_dim", head_size)):
        if value < 1:
            raise ConfigError("--model-dir", path, f"config.json: {field} is {value}, expected at least 1")
    # A multimodal config's dtype may be written at its top level only.
    name = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype") \
        or "bfloat16"
    name = str(name).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ConfigError("--dtype", name, f"unknown; expected one of {', '.join(sorted(_DTYPE_BYTES))}")
    if tp < 1:
        raise ConfigError("--tp", tp, "must be at least 1")
    if cfg.get("kv_lora_rank"):
        # Multi-head latent attention (DeepSeek V2/V3 and kin): one latent
        # vector and one rotary key a token and layer, the same on every
        # rank (not split by tensor parallelism).
        try:
            latent, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0)
        except (TypeError, ValueError) as err:
            raise ConfigError("--model-dir", path, f"config.json: kv_lora_rank or qk_rope_head_dim is not a "
                                                   f"number ({err})") from None
        b = layers * (latent + rope) * _DTYPE_BYTES[name]
        return KvShape(b, f"{path}: {layers} layers x ({latent} latent + {rope} rotary) x {_DTYPE_BYTES[name]} "
                          f"bytes ({name}, MLA: the same on each of TP {tp})", tp, layers)
    per_device_heads = max(1, math.ceil(kv_heads / tp))  # fewer KV heads than ranks: replicated
    b = 2 * layers * per_device_heads * head_size * _DTYPE_BYTES[name]
    return KvShape(b, f"{path}: 2 x {layers} layers x {per_device_heads} KV heads per device x {head_size} x "
                      f"{_DTYPE_BYTES[name]} bytes ({name}, TP {tp})", tp, layers)


# layout.LAYER_ALIGN, repeated so that `kvtier size` does not import torch
# (test_sizing.py checks the figure against the connector's own).
LAYER_ALIGN = 64


def block_rank_bytes(kv: KvShape, block_tokens: int) -> int:
    """Bytes one rank writes for a block of ``block_tokens`` tokens (one
    pipeline stage): each layer's page padded to 64 bytes, as the
    connector lays a block out; what ``kvtier.slot_rank_bytes`` must hold."""
    if kv.layers < 1:
        raise ConfigError("--block-size", block_tokens, "needs --model-dir (a log does not give the layer count)")
    page = block_tokens * round(kv.bytes_per_token) // kv.layers
    return -(-page // LAYER_ALIGN) * LAYER_ALIGN * kv.layers


# "Available KV cache memory: 13.88 GiB" (per device), or in older builds
# "Available memory: 36408063180," (bytes); then "GPU KV cache size: 1,217,457 tokens".
_AVAIL = re.compile(r"Available (?:KV cache )?memory:\s*(\d[\d,]*(?:\.\d+)?)\s*(GiB|GB|MiB|MB|KiB|kB|KB)?")
_TOKENS = re.compile(r"(?:GPU|CPU|Device)?\s*KV cache size:\s*([\d,]+)\s*tokens")
_UNITS = {"GiB": 1 << 30, "GB": 1e9, "MiB": 1 << 20, "MB": 1e6, "KiB": 1024, "kB": 1000, "KB": 1000, "": 1}


def from_log(text: str, devices: int | None = None) -> KvShape:
    """From vLLM's log: "Available KV cache memory" (per device) over "KV
    cache size: N tokens" (the instance's capacity). Each device holds a
    share of every token: memory / N bytes per token per device, devices x
    memory / N for the instance.

    A log may hold several starts: the last run of memory lines and the
    size line(s) right after it count (with several engines, each logs a
    size line after the workers' memory lines). Without ``devices``, the
    device count is the number of those memory lines; vLLM often logs only
    the first worker's, so give ``devices`` (``--devices``) for a
    multi-device instance.
    """
    events = sorted([(m.start(), "size", m) for m in _TOKENS.finditer(text)]
                    + [(m.start(), "mem", m) for m in _AVAIL.finditer(text)], key=lambda e: e[0])
    sizes = [m for _, kind, m in events if kind == "size"]
    if not sizes:
        raise ConfigError("--log", "", "no 'KV cache size: N tokens' line found")
    last = sizes[-1]
    # Walk back from the last size line: past the size lines next to it,
    # then over the memory lines before them, up to an earlier size line.
    i = max(n for n, (_, kind, m) in enumerate(events) if m is last)
    while i >= 0 and events[i][1] == "size":
        i -= 1
    mems = []
    while i >= 0 and events[i][1] == "mem":
        v, u = events[i][2].groups()
        mems.append(float(v.replace(",", "")) * _UNITS[u or ""])
        i -= 1
    if not mems:
        raise ConfigError("--log", "", "no 'Available KV cache memory: X GiB' line before the last "
                                       "'KV cache size' line")
    if devices is not None and devices < 1:
        raise ConfigError("--devices", devices, "must be at least 1")
    n_dev = devices or len(mems)
    mem = sum(mems) / len(mems)
    tokens = int(last.group(1).replace(",", ""))
    return KvShape(mem / tokens, f"vLLM log: {mem / (1 << 30):.2f} GiB per device, {tokens:,} tokens, "
                                 f"{n_dev} device(s)", n_dev)


def workload_bytes_per_device(kv: KvShape, concurrency: int, mean_tokens: float) -> float:
    return concurrency * mean_tokens * HEADROOM * kv.bytes_per_token


def host_memory_bytes(devices: int, dram_bytes_per_device: int, staging_bytes_per_device: int) -> int:
    return devices * (dram_bytes_per_device + staging_bytes_per_device)


def hugepage_size_bytes(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("meminfo", meminfo, "no Hugepagesize line")


def hugepages_for(size_bytes: int, page_bytes: int, buffer_bytes: int = 0) -> int:
    return math.ceil((size_bytes + buffer_bytes) / page_bytes)


@dataclass(frozen=True)
class PoolTotals:
    """A node's memory for the pool, per the seeds' formula: devices x (dram.size + ubsio.mem.size_in_gb)."""

    devices: int
    dram_per_device_bytes: int
    staging_per_device_bytes: int  # UBS-IO's pool in MemCache; kvtier allocates none (0 without SSD)
    dram_bytes: int  # the node's DRAM arena
    staging_bytes: int
    host_bytes: int
    ssd_paths: tuple[str, ...]
    sources: tuple[str, ...]


def pool_totals(cfg: PoolConfig) -> PoolTotals:
    staging = cfg.staging_size_per_device  # 0 unless the SSD tier is on
    return PoolTotals(cfg.devices, cfg.dram_size_per_device, staging, cfg.dram_bytes, cfg.devices * staging,
                      host_memory_bytes(cfg.devices, cfg.dram_size_per_device, staging), cfg.ssd_paths,
                      cfg.sources)


def format_pool_totals(t: PoolTotals) -> str:
    gib = 1 << 30
    where = ", ".join(t.sources) or "defaults"
    head = (f"pool ({where}): {t.devices} device(s) x ({t.dram_per_device_bytes / gib:.1f} GiB DRAM tier + "
            f"{t.staging_per_device_bytes / gib:.1f} GiB SSD staging) = {t.host_bytes / gib:.1f} GiB host memory")
    lines = [head, f"  DRAM arena of the node: {t.dram_bytes / gib:.1f} GiB"]
    lines.append("  " + format_page_tables(t.dram_bytes))
    if t.ssd_paths:
        lines.append(f"  SSD tier: {':'.join(t.ssd_paths)}")
    return "\n".join(lines)


def format_page_tables(arena_bytes: int) -> str:
    return (f"page tables: {page_table_bytes(arena_bytes) / (1 << 20):,.0f} MiB in each process that maps the "
            f"arena (the meta service and every vLLM worker) on 4 KiB pages, "
            f"{page_table_bytes(arena_bytes, 2 << 20) / 1024:,.0f} KiB on 2 MiB huge pages")


def page_table_bytes(mapped_bytes: int, page_bytes: int = 4096) -> int:
    """The last level of page tables a process needs to map ``mapped_bytes``
    (8 bytes an entry, a page an entry). Every process that maps the arena
    fills its own: the arena is mapped with MAP_POPULATE, and x86 shares no
    page tables of shared memory between processes (hugetlbfs aside)."""
    return -(-mapped_bytes // page_bytes) * 8
