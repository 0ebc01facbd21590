"""ZeRO-3 over the store: Zero3Optimizer, OffloadConfig, zero.Init, GatheredParameters, TiledLinear, checkpoints.
See docs/zero.md.

Imports the store, partition and quant layers; nothing below imports this package.
"""
from __future__ import annotations

from .checkpoint import consolidate
from .config import OffloadConfig
from .gathered import GatheredParameters
from .hooks import register_external_parameter
from .init import Init
from .optimizer import Zero3Optimizer
from .tiled import TiledLinear

__all__ = ["GatheredParameters", "Init", "OffloadConfig", "TiledLinear", "Zero3Optimizer", "consolidate",
           "register_external_parameter"]
