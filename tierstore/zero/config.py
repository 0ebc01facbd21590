"""OffloadConfig: where every ZeRO-3 state lives, how it is encoded, and how the step is pipelined.

``OffloadConfig.from_deepspeed(ds_config)`` maps a DeepSpeed config (``zero_optimization``, ``offload_param``,
``offload_optimizer``, ``fp16``/``bf16``, ``gradient_clipping``) so an existing setup migrates; keys it does not
map are listed in one warning. The mapping itself is ds_mapping.py's, shared with ``tierstore.zero.from_deepspeed``
(ds_config.py), which also builds the optimizer and scheduler and checks the batch keys.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TierstoreTypeError, TierstoreValueError
from ..tiers import tier_info
from . import validate
from .validate import known_fields

log = logging.getLogger("tierstore.zero")

@known_fields  # an unknown field is a TierstoreTypeError naming it and the closest field
@dataclass
class OffloadConfig:
    """Where ZeRO-3 keeps things, per rank.

    params: tier of this rank's parameter shards in the compute dtype (gathered before use).
    optimizer_states: tier of the fp32 master shards and the optimizer's states.
    gradients: tier of this rank's gradient partition (accumulated between steps; fp32, see gradient_dtype).
    gradient_dtype: dtype the gradient partitions are stored in on a persistent (nvme) tier: torch.float32
        (default: exact accumulation) or the compute dtype (bfloat16 / float16: half the gradient bytes to and
        from the disk; the accumulated partition is rounded to it each time it is written). Masters and states
        stay fp32; on memory tiers the partitions stay fp32. See [Note: gradient dtype on nvme] in
        grad_partitions.py.
    nvme_paths: directories (one per drive) for the nvme tier; each rank uses ``<path>/rank<r>``. Needed when
        any tier is 'nvme'; otherwise a temporary directory holds the store's (empty) files.
    state_codec: None (fp32 states) or 'dynamic8' (exp_avg / exp_avg_sq in block-wise dynamic 8 bits when
        stored on nvme, per tierstore.quant.states.StatePolicy).
    quantized_weights: qwZ, an int8 all-gather of parameter shards (world > 1).
    quantized_gradients: qgZ, an int4 all-to-all reduce-scatter of gradients (world > 1).
    hpz_partition_size: hpZ, a secondary copy of the parameters partitioned over this many ranks (a node), so
        backward's all-gathers stay inside it (zero/hpz.py, [Note: hpZ]); 1 (off), a divisor of the world
        size, or 'node' (ranks per node from LOCAL_WORLD_SIZE, else from the ranks' host names).
    compute_dtype: dtype of the gathered parameters the model computes with; masters stay fp32.
    prefetch_depth: modules ahead of use whose buckets are prepared (traced prefetch; 0: off): shards read up
        from the store and copied to the device 2 x depth modules ahead, all-gathers posted depth ahead
        (world size > 1).
    prefetch_bytes: beyond those modules, further modules' shards are read ahead while the shards read ahead
        and not yet used add up to at most this (bytes, per rank; 0: depth modules only), several reads at
        once: small layers (a few MiB each) otherwise leave the disk one request deep. See [Note: reading
        ahead by bytes] in prefetch.py.
    reuse_bytes: gathered parameters the end of forward keeps for the start of backward (bytes, per rank;
        DeepSpeed's stage3_max_reuse_distance in spirit): the buckets the forward's last module calls use,
        as many as fit in this, are not released and gathered (read) again -- backward needs them first.
        The same budget bounds the masters backward read that the step takes ([Note: masters at hand]) and,
        with fp32 masters shared with the parameters on nvme, the masters the step wrote that the next
        forward takes instead of reading them, within prefetch_bytes too ([Note: stepped masters kept for
        the forward]).
        None (default): 2 x sub_group_bytes; 0: off. See [Note: kept at the turn] in hooks.py.
    sub_group_bytes: bytes of one bucket (a sub-group of the step pipeline), all ranks together.
    min_io_bytes: small parameters are packed until each rank's shard of a bucket reaches this (bytes).
    pinned_bytes: page-locked staging budget the nvme tier streams through (bytes).
    pipeline_depth: sub-groups in flight in the step (read i+1, step i, write i-1 is 3); with overlap_step,
        backward also queues sub-groups for it up to pipeline_depth x sub_group_bytes ([Note: the stream's
        queue is in bytes] in pipeline.py).
    initial_loss_scale, loss_scale_window, min_loss_scale: fp16 dynamic loss scaling.
    overlap_step: step each sub-group during backward, as soon as its gradient is final, on the step
        pipeline's threads (at world size N once every rank's reduce-scatter of it is final; the backward of
        the last micro-batch, i.e. outside ``opt.accumulating()``); ``opt.step()`` then finishes the step.
        See [Note: overlapped step] in optimizer.py. Not with float16 (the loss scaler needs every gradient
        before any step).
    clip_mode: "exact" (clip_grad_norm_ after backward, applied by the next step(); refused once a backward
        ran with overlap_step) or "previous_norm" (with overlap_step: each step clips with the
        max_norm and the global norm the previous clip_grad_norm_ call gave; the first step is not clipped).
    gradient_clipping: when set (> 0), step() clips the gradients to this global L2 norm, unless
        clip_grad_norm_ was called since the last step (DeepSpeed's `gradient_clipping`). None or 0: off.
    activation_offload: None, 'host' or 'nvme': the tensors the model's forward saves for backward go to that
        tier (tierstore.ActivationOffload, attached to the ZeRO-3 hooks; docs/activations.md); 'nvme' uses
        ``<nvme_path>/activations-rank<r>``. activation_mode: 'all' or 'checkpoint' (only the inputs
        torch.utils.checkpoint keeps). activation_budget_bytes: the most bytes offloaded at once (None: no
        limit). activation_compress: None (exact), 'bf16' or a quantization scheme ('int8'), nvme only.
    io_tuning: path of a `tierstore tune DIR` recommendation for the store's I/O (see tierstore/io/tuning.py).
    """

    params: str = "device"
    optimizer_states: str = "host"
    gradients: str = "host"
    nvme_paths: Sequence[str] | None = None
    state_codec: str | None = None
    quantized_weights: bool = False
    quantized_gradients: bool = False
    compute_dtype: torch.dtype = torch.float32
    gradient_dtype: torch.dtype = torch.float32
    prefetch_depth: int = 2
    prefetch_bytes: int = 64 << 20  # bytes
    reuse_bytes: int | None = None  # bytes; None: 2 x sub_group_bytes
    sub_group_bytes: int = 64 << 20  # bytes
    min_io_bytes: int = 1 << 20  # bytes
    pinned_bytes: int = 64 << 20  # bytes
    pipeline_depth: int = 3  # sub-groups
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000  # steps without overflow before the scale doubles
    min_loss_scale: float = 1.0
    intra_node_size: int | None = None  # qgZ: ranks per node (default: all)
    gradient_clipping: float | None = None  # clip to this global L2 norm at each step unless clipped already
    hpz_partition_size: int | str = 1  # hpZ: ranks per secondary partition (1: off; 'node': ranks per node)
    overlap_step: bool = False
    clip_mode: str = "exact"
    activation_offload: str | None = None  # None, 'host' or 'nvme'
    activation_mode: str = "all"  # 'all' or 'checkpoint'
    activation_budget_bytes: int | None = None  # bytes
    activation_compress: str | None = None
    io_tuning: str | None = None
    extra: dict = field(default_factory=dict)  # keys from_deepspeed could not map, kept for reference

    def __post_init__(self) -> None:
        validate.offload_config(self)  # every field checked, nvme_paths made a list

    @classmethod
    def coerce(cls, config: Any, argument: str = "config") -> OffloadConfig:
        """`config` as an OffloadConfig: one already, None (the defaults), or a dict of its fields (an unknown
        key is refused naming it); anything else is a TierstoreValueError naming `argument`."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping):
            if any(k in config for k in ("zero_optimization", "train_batch_size", "optimizer", "fp16", "bf16")):
                raise TierstoreValueError(f"{argument}= looks like a DeepSpeed config; pass "
                                          f"{argument}=OffloadConfig.from_deepspeed(ds_config), or use "
                                          "tierstore.zero.from_deepspeed(ds_config, ...).build_optimizer(model)")
            bad = [k for k in config if not isinstance(k, str)]
            if bad:
                raise TierstoreTypeError(f"{argument}: the keys of a config dict are OffloadConfig's field names; "
                                         f"got {bad[0]!r}")
            return cls(**config)
        raise TierstoreTypeError(f"{argument}={config!r}: pass a tierstore.zero.OffloadConfig (or a dict of its "
                                 f"fields, or None for the defaults); got {type(config).__name__}")

    @property
    def reuse_budget(self) -> int:
        """reuse_bytes resolved: bytes the end of forward may keep for backward."""
        return 2 * self.sub_group_bytes if self.reuse_bytes is None else self.reuse_bytes

    @property
    def uses_nvme(self) -> bool:
        """Some state lives on a persistent tier (it needs nvme_paths)."""
        return any(tier_info(t).persistent for t in (self.params, self.optimizer_states, self.gradients))

    def replace(self, **changes) -> OffloadConfig:
        """A copy with some fields changed (e.g. other tiers to load a checkpoint into)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compute_dtype"] = str(self.compute_dtype).removeprefix("torch.")
        d["gradient_dtype"] = str(self.gradient_dtype).removeprefix("torch.")
        d["nvme_paths"] = list(self.nvme_paths) if self.nvme_paths else None
        return d

    @classmethod
    def from_deepspeed(cls, ds_config: Mapping[str, Any] | str | os.PathLike, **overrides) -> OffloadConfig:
        """The OffloadConfig of a DeepSpeed config (a dict or a JSON file's path); `overrides` (OffloadConfig
        fields) win and resolve its "auto" values (compute_dtype=... for fp16/bf16.enabled "auto",
        gradient_clipping=... for gradient_clipping "auto"). Warns once, naming every key it ignores.

        This reads only what OffloadConfig holds: `tierstore.zero.from_deepspeed(ds_config, lr=..., ...)` also
        builds the config's optimizer and scheduler and checks its batch sizes (docs/zero.md). Here the
        optimizer, scheduler and batch keys are named in the warning as not built."""
        from .ds_mapping import map_deepspeed
        m = map_deepspeed(ds_config, overrides)
        names = m.ignored + [f"{k} (not built here: tierstore.zero.from_deepspeed builds it)" for k in m.rest]
        if names:
            warnings.warn("OffloadConfig.from_deepspeed ignored: " + ", ".join(names), stacklevel=2)
        m.config.extra["ignored"] = names
        return m.config
