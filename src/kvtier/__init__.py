"""kvtier: a tiered KV-cache pool for vLLM (DRAM and SSD tiers behind a KV connector)."""

__version__ = "0.1.0"
