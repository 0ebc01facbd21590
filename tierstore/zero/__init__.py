"""ZeRO-3 over the store: Zero3Optimizer, OffloadConfig, zero.Init, TiledLinear, checkpoints. See docs/zero.md.

Imports the store, partition and quant layers; nothing below imports this package.
"""
from __future__ import annotations

from .config import OffloadConfig
from .optimizer import Zero3Optimizer

__all__ = ["OffloadConfig", "Zero3Optimizer"]

from .checkpoint import consolidate  # noqa: E402

__all__ += ["consolidate"]
