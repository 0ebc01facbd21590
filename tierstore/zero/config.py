"""OffloadConfig: where every ZeRO-3 state lives, how it is encoded, and how the step is pipelined.

Each field is declared with ``knob(default, group=..., doc=..., bound=...)``: a dataclass field whose metadata
holds its group (GROUPS: where things live, precision, the pipeline's memory, overlap, collectives,
activations, I/O), a one-line doc, and, for a knob that sets a memory bound, the key of that bound in
MEMORY_BOUNDS. Users still construct and read the fields flat (``OffloadConfig(params="host")``,
``config.params``); the groups are for reading: ``config.describe()``, and the reference in docs/zero.md,
generated from the same metadata (config_docs.py; ``python -m tierstore.zero.config_docs --write`` rewrites
it). A first run needs only the tiers and nvme_paths: every other default is the one to start from. The
checks of the fields are validate.py's; the DeepSpeed config mapping behind ``from_deepspeed`` is
ds_mapping.py's.

[Note: memory bounds]
The memory ZeRO-3 holds beyond the model's own compute is bounded by a few knobs, and most bound several
mechanisms at once: ``reuse_bytes`` bounds three kinds of values kept for a next use, and ``pipeline_depth x
sub_group_bytes`` four queues and pools of the step. Each bound is stated once, in MEMORY_BOUNDS below: what
sets it, and every mechanism it covers (each with its own Note); a field's metadata names the bound it sets
instead of repeating it, and the list in docs/zero.md is generated from this one. A mechanism that adds
a new use of a knob's memory adds a line to its bound here. ``OffloadConfig.describe()`` shows what each
bound comes to for a config.
"""
from __future__ import annotations

import dataclasses
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

# group -> its title, in the order describe() and the reference table show them
GROUPS = {
    "tiers": "Where things live",
    "precision": "Precision",
    "memory": "The pipeline's memory",
    "overlap": "Overlap",
    "collectives": "Collectives (world size > 1)",
    "activations": "Activations",
    "io": "I/O",
    "record": "Record",
}


@dataclass(frozen=True)
class MemoryBound:
    """One bound on the memory ZeRO-3 holds: the knobs that set it (as a formula), what it covers."""
    sets: str  # the knobs, as a formula (`code`)
    what: str  # what is bounded, in a phrase
    covers: tuple[str, ...]  # each mechanism the bound covers, citing its Note


# every bound, once ([Note: memory bounds]); a field's "bound" metadata is a key of this
MEMORY_BOUNDS: dict[str, MemoryBound] = {
    "reuse": MemoryBound(
        "reuse_bytes (None: 2 x sub_group_bytes)",
        "values kept for their next use instead of read again",
        ("the buckets the forward's last module calls use, kept (not released) for the start of backward "
         "([Note: kept at the turn])",
         "at world size 1, with fp32 compute and the parameters on the states' tier, nvme, the masters "
         "backward read (with split masters their bfloat16 halves), kept for the step "
         "([Note: masters at hand]); with overlap_step, plus the step queue's bytes (the \"step\" bound)",
         "with fp32 compute and the parameters on the states' tier, nvme, the masters the step wrote, kept "
         "for the next forward's first buckets, also within prefetch_bytes "
         "([Note: stepped masters kept for the forward])")),
    "step": MemoryBound(
        "pipeline_depth x sub_group_bytes",
        "the step pipeline's sub-groups in flight",
        ("the step's sub-groups loaded ahead of the one stepped, at most max(1, (pipeline_depth - 1) // 2) x "
         "sub_group_bytes, and those stepped and not yet saved ([Note: step pipeline])",
         "2 x: buffers lent to writes (the step's writer, backward's gradient writes to nvme) before the "
         "lender waits for the disk; at most 2 x pipeline_depth free buffers kept per shape "
         "([Note: lent buffers are bounded])",
         "with overlap_step, 1 x: the sub-groups backward queued for the step and not yet saved, before "
         "backward waits ([Note: the stream's queue is in bytes])",
         "with overlap_step, 1 x on top of reuse_bytes: the masters at hand kept while their sub-groups wait "
         "in that queue ([Note: masters at hand])")),
    "read_ahead": MemoryBound(
        "prefetch_depth modules + prefetch_bytes",
        "the parameters read (and gathered) ahead of their use",
        ("the buckets of the next prefetch_depth modules, prepared ahead: at world size > 1 all-gathered "
         "ahead, their shards read 2 x prefetch_depth modules ahead ([Note: prefetch stages])",
         "beyond those modules, the shards read ahead and not yet used: at most prefetch_bytes per rank "
         "([Note: reading ahead by bytes])",
         "prefetch_bytes also caps the stepped masters kept for the forward (the \"reuse\" bound)")),
    "pinned": MemoryBound(
        "pinned_bytes",
        "page-locked host memory",
        ("the staging the store's nvme tier streams reads and writes through (the optimizer's store and "
         "zero.Init's)",)),
    "activations": MemoryBound(
        "activation_budget_bytes (None: no limit)",
        "saved activations held by the store",
        ("the activations offloaded and not yet read back; past it tensors stay in memory (docs/activations.md)",)),
}


def knob(default: Any = dataclasses.MISSING, *, group: str, doc: str, bound: str | None = None,
         shown: str | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """An OffloadConfig field with its metadata: `group` (a key of GROUPS), a one-line `doc`, the `bound` it sets
    (a key of MEMORY_BOUNDS, for memory knobs) and how its default is `shown` (default: from its value)."""
    assert group in GROUPS and (bound is None or bound in MEMORY_BOUNDS), (group, bound)
    return field(default=default, default_factory=default_factory,
                 metadata={"group": group, "doc": doc, "bound": bound, "shown": shown})


@known_fields  # an unknown field is a TierstoreTypeError naming it and the closest field
@dataclass
class OffloadConfig:
    """Where ZeRO-3 keeps things, per rank, and how its pipeline runs. Each field's doc is in its metadata
    (``dataclasses.fields(OffloadConfig)[i].metadata["doc"]``), shown grouped by ``describe()`` and in
    docs/zero.md's table; the memory bounds the knobs set are [Note: memory bounds]. A first run needs only
    ``params``, ``optimizer_states``, ``gradients`` and ``nvme_paths``."""

    # The order is the positional order: new fields go last.
    params: str = knob(
        "device", group="tiers",
        doc="tier of this rank's parameter shards in the compute dtype (gathered before use): 'device', 'host' "
            "or 'nvme'")
    optimizer_states: str = knob(
        "host", group="tiers", doc="tier of the fp32 master shards and the inner optimizer's states")
    gradients: str = knob(
        "host", group="tiers",
        doc="tier of this rank's gradient partition (accumulated between steps; fp32, see gradient_dtype)")
    nvme_paths: Sequence[str] | None = knob(
        None, group="tiers",
        doc="directories for the nvme tier, one per drive (a str / Path or a list of them); needed when a tier "
            "is 'nvme'. Rank r uses `<path>/rank<r>` (zero.Init `init-rank<r>`, activations "
            "`activations-rank<r>`), its own scratch: marked, started empty every run, and anything else at "
            "that name is refused before anything is written ([Note: scratch directories are marked])")
    state_codec: str | None = knob(
        None, group="precision",
        doc="'dynamic8': exp_avg / exp_avg_sq in block-wise dynamic 8 bits when stored on nvme "
            "([Note: 8-bit states]); None: fp32 states")
    quantized_weights: bool = knob(
        False, group="collectives", doc="qwZ: parameter shards all-gathered in int8")
    quantized_gradients: bool = knob(
        False, group="collectives", doc="qgZ: gradients reduce-scattered by an int4 all-to-all")
    compute_dtype: torch.dtype = knob(
        torch.float32, group="precision",
        doc="dtype of the gathered parameters the model computes with (float32, bfloat16, or float16 with "
            "dynamic loss scaling); masters stay fp32 (see split_master)")
    gradient_dtype: torch.dtype = knob(
        torch.float32, group="precision",
        doc="dtype of the gradient partitions on a persistent (nvme) tier: float32 (exact accumulation) or the "
            "compute dtype (half the gradient bytes to and from the disk; rounded to it each time it is "
            "written, [Note: gradient dtype on nvme]); fp32 on memory tiers")
    prefetch_depth: int = knob(
        2, group="overlap", bound="read_ahead",
        doc="modules ahead of use whose buckets are prepared: shards read 2 x depth modules ahead, all-gathers "
            "posted depth ahead (world size > 1); 0: off ([Note: prefetch stages])")
    prefetch_bytes: int = knob(
        64 << 20, group="overlap", bound="read_ahead",
        doc="beyond those modules, further shards are read ahead, several at once, while the ones read and not "
            "yet used fit in this (bytes per rank): small layers keep the disk busy "
            "([Note: reading ahead by bytes]); 0: by modules only")
    reuse_bytes: int | None = knob(
        None, group="memory", bound="reuse", shown="None (2 x sub_group_bytes)",
        doc="gathered values kept where they are used next instead of read again (bytes per rank; DeepSpeed's "
            "stage3_max_reuse_distance in spirit); 0: off")
    sub_group_bytes: int = knob(
        64 << 20, group="memory", bound="step",
        doc="bytes of one bucket, all ranks together: the unit of the gathers, the reduce-scatters and the "
            "step pipeline (a sub-group)")
    min_io_bytes: int = knob(
        1 << 20, group="io",
        doc="small parameters are packed together until each rank's shard of a bucket reaches this (bytes)")
    pinned_bytes: int = knob(
        64 << 20, group="memory", bound="pinned",
        doc="page-locked staging the nvme tier streams through (bytes; at least 1 MiB)")
    pipeline_depth: int = knob(
        3, group="memory", bound="step",
        doc="sub-groups in flight in the step: read i+1, step i, write i-1 is 3 ([Note: step pipeline])")
    initial_loss_scale: float = knob(
        2.0 ** 16, group="precision", shown="2^16", doc="float16: the dynamic loss scale to start from")
    loss_scale_window: int = knob(
        1000, group="precision", doc="float16: steps without an overflow before the loss scale doubles")
    min_loss_scale: float = knob(
        1.0, group="precision", doc="float16: the loss scale never halves below this")
    intra_node_size: int | None = knob(
        None, group="collectives", doc="qgZ: ranks per node (None: all ranks)")
    gradient_clipping: float | None = knob(
        None, group="precision",
        doc="clip the gradients to this global L2 norm at each step() unless clip_grad_norm_ was called since "
            "the last one (DeepSpeed's gradient_clipping); None or 0: off")
    hpz_partition_size: int | str = knob(
        1, group="collectives",
        doc="hpZ: a secondary copy of the parameters partitioned over this many ranks (a node), so backward's "
            "all-gathers stay inside it; 1: off, a divisor of the world size, or 'node' ([Note: hpZ])")
    overlap_step: bool | str = knob(
        "auto", group="overlap",
        doc="step each sub-group during backward as soon as its gradient is final (at world size N, once every "
            "rank's reduce-scatter of it is), on the pipeline's threads; opt.step() finishes the step; "
            "micro-batches that are not the last run inside `with opt.accumulating():` "
            "([Note: overlapped step]). 'auto': from the second step on wherever it gives the plain step's result "
            "and saves something -- no float16, no exact gradient_clipping, some state on nvme or off the compute "
            "device, a loop that clips nothing and runs one backward per step "
            "([Note: the overlapped step by default]); True: always (not with float16); False: never")
    clip_mode: str = knob(
        "exact", group="overlap",
        doc="'exact': clip_grad_norm_ after backward, applied by the next step() (refused after a backward that "
            "stepped sub-groups: overlap_step=True, or 'auto' once chosen); 'previous_norm': each step clips "
            "with the max_norm and global norm of the clip_grad_norm_ call before it (the first step is not "
            "clipped) -- what overlap_step needs to clip")
    activation_offload: str | None = knob(
        None, group="activations",
        doc="'host' or 'nvme': the tensors the forward saves for backward go to that tier "
            "(tierstore.ActivationOffload, docs/activations.md); 'nvme' uses `<nvme_path>/activations-rank<r>`")
    activation_mode: str = knob(
        "all", group="activations",
        doc="what is offloaded: 'all', or 'checkpoint' (only the inputs torch.utils.checkpoint keeps)")
    activation_budget_bytes: int | None = knob(
        None, group="activations", bound="activations", doc="the most bytes offloaded at once (None: no limit)")
    activation_compress: str | None = knob(
        None, group="activations",
        doc="nvme only: None (exact), 'bf16', or a quantization scheme such as 'int8'")
    io_tuning: str | None = knob(
        None, group="io", doc="path of a `tierstore tune DIR` recommendation for the store's I/O (docs/io.md)")
    extra: dict = knob(
        group="record", default_factory=dict, shown="{}",
        doc="what from_deepspeed could not map (`extra['ignored']`), kept for reference")
    split_master: bool | str = knob(
        "auto", group="precision",
        doc="bfloat16 compute with the parameters on the optimizer states' tier: each fp32 master is stored as "
            "its bfloat16 parameter shard plus an int16 remainder, 2 + 2 bytes a parameter instead of 2 + 4 (a "
            "master exactly half way between two bfloat16 values moves one fp32 ulp, [Note: split master]); "
            "'auto': where that tier is nvme (2 bytes less read and written a step); True: on any tier (also "
            "2 bytes less memory on host, its step then one sub-group at a time); False: fp32 masters")

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
        """reuse_bytes resolved: the "reuse" bound in bytes ([Note: memory bounds])."""
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

    def describe(self) -> str:
        """The fields by group, one line a group (a value not the default is marked *), then what the memory
        bounds come to ([Note: memory bounds])."""
        lines = ["OffloadConfig"]
        for group, title in GROUPS.items():
            items = [f"{f.name}={show(f.name, getattr(self, f.name))}{'' if is_default(f, self) else '*'}"
                     for f in dataclasses.fields(self) if f.metadata["group"] == group]
            lines.append(f"  {title}: {', '.join(items)}")
        mib = lambda n: show("_bytes", n)  # noqa: E731
        step = self.pipeline_depth * self.sub_group_bytes
        limit = self.activation_budget_bytes
        lines.append(f"  Memory bounds: reuse {mib(self.reuse_budget)}; step {mib(step)} (lent buffers "
                     f"{mib(2 * step)}); read_ahead {self.prefetch_depth} modules + {mib(self.prefetch_bytes)}; "
                     f"pinned {mib(self.pinned_bytes)}; activations "
                     f"{'no limit' if limit is None else mib(limit)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_deepspeed(cls, ds_config: Mapping[str, Any] | str | os.PathLike, **overrides) -> OffloadConfig:
        """The OffloadConfig of a DeepSpeed config (a dict or a JSON file's path); `overrides` (OffloadConfig
        fields) win and resolve its "auto" values (compute_dtype=... for fp16/bf16.enabled "auto",
        gradient_clipping=... for gradient_clipping "auto"). Warns once, naming every key it ignores.

        This reads only what OffloadConfig holds: `tierstore.zero.from_deepspeed(ds_config, lr=..., ...)` also
        builds the config's optimizer and scheduler and checks its batch sizes (docs/zero.md). Here the
        optimizer, scheduler and batch keys are named in the warning as not built."""
        from .ds_mapping import map_deepspeed
        m = map_deepspeed(ds_config, overrides, cls)
        names = m.ignored + [f"{k} (not built here: tierstore.zero.from_deepspeed builds it)" for k in m.rest]
        if names:
            warnings.warn("OffloadConfig.from_deepspeed ignored: " + ", ".join(names), stacklevel=2)
        m.config.extra["ignored"] = names
        return m.config


def show(name: str, value: Any) -> str:
    """A value of field `name` as describe() and the reference show it: a dtype without "torch.", a byte count
    (a field named *_bytes) of whole MiB in MiB, anything else as repr()."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if name.endswith("_bytes") and isinstance(value, int) and value and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return repr(value)


def is_default(f: dataclasses.Field, config: OffloadConfig) -> bool:
    """Whether `config`'s field `f` holds its default."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return bool(getattr(config, f.name) == default)
