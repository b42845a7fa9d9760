"""Tiers: physical places that hold blocks in fixed-size slots.

A tier knows slots, bytes and per-slot headers; it knows nothing of keys'
meaning, LRU order or pins (the store owns those). Only modules in this
package touch mmap or O_DIRECT.
"""

from kvtier.tier.dram import DramTier, SlotHeader

__all__ = ["DramTier", "SlotHeader"]
