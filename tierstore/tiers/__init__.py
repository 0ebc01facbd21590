"""The three tiers a tensor can live on, fastest first: accelerator memory, page-locked host memory, NVMe files.

Each tier is a small object that owns its memory (or files), its byte budget and its transfer statistics;
which tensor lives where is decided one layer up (residency.py). The tiers are listed once, with their
capabilities, in `REGISTRY` (base.py); `MemoryTier` and `PersistentTier` are the contracts a tier class keeps.
"""
from .base import (
    MEMORY_TIERS,
    PERSISTENT_TIERS,
    REGISTRY,
    TIERS,
    Budget,
    MemoryTier,
    PersistentTier,
    Tier,
    TierInfo,
    TierStats,
    profile_range,
    tier_index,
    tier_info,
)
from .device import DeviceTier, default_device
from .host import HostTier
from .nvme import Extent, ExtentAllocator, NvmeTier

__all__ = ["MEMORY_TIERS", "PERSISTENT_TIERS", "REGISTRY", "TIERS", "Budget", "DeviceTier", "Extent",
           "ExtentAllocator", "HostTier", "MemoryTier", "NvmeTier", "PersistentTier", "Tier", "TierInfo",
           "TierStats", "default_device", "profile_range", "tier_index", "tier_info"]
