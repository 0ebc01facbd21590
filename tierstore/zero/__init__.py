"""ZeRO-3 over the store: Zero3Optimizer, OffloadConfig, zero.Init, GatheredParameters, TiledLinear, checkpoints;
offloaded inference (offload_for_inference). See docs/zero.md and docs/inference.md.

Imports the store, partition and quant layers; nothing below imports this package.
"""
from __future__ import annotations

from .checkpoint import consolidate, rng_state, set_rng_state
from .config import OffloadConfig
from .ds_config import DeepSpeedSetup, from_deepspeed
from .hooks.coordinator import register_external_parameter
from .inference.offload import InferenceStats, OffloadedModel, offload_for_inference
from .optimizer import Zero3Optimizer
from .params.gathered import GatheredParameters
from .params.init import Init
from .params.registry import optimizer_of
from .params.tiled import TiledLinear
from .release import release_model

__all__ = ["DeepSpeedSetup", "GatheredParameters", "InferenceStats", "Init", "OffloadConfig", "OffloadedModel",
           "TiledLinear", "Zero3Optimizer", "consolidate", "from_deepspeed", "offload_for_inference", "optimizer_of",
           "register_external_parameter", "release_model", "rng_state", "set_rng_state"]
