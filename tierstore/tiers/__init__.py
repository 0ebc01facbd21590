"""The three tiers a tensor can live on, fastest first: accelerator memory, page-locked host memory, NVMe files.

Each tier is a small object that owns its memory (or files), its byte budget and its transfer statistics;
which tensor lives where is decided one layer up (tensor.py / store.py).
"""
from .base import TIERS, Budget, TierStats, profile_range, tier_index
from .device import DeviceTier, default_device
from .host import HostTier
from .nvme import Extent, ExtentAllocator, NvmeTier

__all__ = ["TIERS", "Budget", "DeviceTier", "Extent", "ExtentAllocator", "HostTier", "NvmeTier", "TierStats",
           "default_device", "profile_range", "tier_index"]
