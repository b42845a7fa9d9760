"""Eviction policies. A policy only orders keys; pins, slots and counts live in the store."""

from kvtier.policy.lru import EvictionPolicy, LruPolicy

__all__ = ["EvictionPolicy", "LruPolicy"]
