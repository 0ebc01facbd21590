"""Zero3Optimizer: a drop-in ZeRO-3 optimizer that keeps every state in a tierstore Store.

    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1, config=OffloadConfig(...))
    loss = model(batch).mean(); loss.backward(); opt.step(); opt.zero_grad()

[Note: thin wrapper over an elementwise optimizer]
Every parameter is partitioned over the ranks by the bandwidth-centric plan (``tierstore.partition``); each
rank keeps, per bucket ("sub-group"), its shard of the parameters in the compute dtype (tier ``params``),
an fp32 master shard and the optimizer's states (tier ``optimizer_states``) and an fp32 gradient partition
(tier ``gradients``). The inner torch optimizer is built over one flat placeholder tensor per sub-group;
to step sub-group i the placeholder's ``.data`` becomes the master shard, its ``.grad`` the gradient
partition and ``inner.state[placeholder]`` the states read from the store; ``inner.step()`` updates only it
(torch optimizers skip parameters whose grad is None), and the results go back to the store. This is exact
for optimizers whose update is elementwise -- each element's new value depends only on that element's
parameter, gradient and states, and on scalars (lr, step count) -- so the allow-list below is checked and
anything else is refused: a factored (Adafactor) or line-search (LBFGS) update over a flat shard would
silently be a different optimizer.
As in torch (and unlike DeepSpeed, which steps it with a zero gradient), a parameter that got no gradient
since zero_grad() is not stepped: see [Note: skipped parameters] in skipped.py.

The step is made of small parts, each in its module: the sub-group stepper (stepper.py: load -> step -> save,
handed over as a LoadedSubgroup), the 8-bit states (state8.py), skipped parameters (skipped.py) and the store
names (keys.py). checkpoint.py uses the interface of [Note: checkpoint interface] below.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import MisuseError, TierstoreValueError
from ..store import Store
from ..tiers import tier_info
from . import _dist, clip, keys, registry, release, scratch, validate
from ._layout import Layout
from .config import OffloadConfig
from .disk_bytes import KINDS, DiskBytes
from .grad_partitions import GradPartitions
from .hooks import ParamCoordinator
from .hpz import Hpz
from .module_state import ModuleState
from .pipeline import StepStream
from .skipped import SkippedParams
from .state8 import EightBitStates, fused8_capable
from .stepper import BufferPool, SubgroupStepper

log = logging.getLogger("tierstore.zero")

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Rprop", "ASGD")
STATE_FORMAT = "tierstore.zero.optimizer/1"


def _zero_model_and_partitions(model_zero_grad, opt_ref, set_to_none: bool = True) -> None:
    """model.zero_grad() of a model under a Zero3Optimizer ([Note: model.zero_grad() forgets the partitions]);
    the optimizer is held weakly (the model must not keep it, and its store, alive)."""
    model_zero_grad(set_to_none)
    opt = opt_ref()
    if opt is not None and getattr(opt, "store", None) is not None:
        opt.zero_grad(set_to_none)


def _check_elementwise(cls, elementwise_ok: bool) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TierstoreValueError(f"optimizer_class={cls!r} must be a torch.optim.Optimizer subclass, e.g. "
                                  f"torch.optim.AdamW (the class, not an instance)")
    ok = cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE
    if not ok and not elementwise_ok:
        raise TierstoreValueError(
            f"{cls.__module__}.{cls.__name__} is not a known elementwise optimizer; Zero3Optimizer steps flat "
            f"shards of many parameters at once, which is only the same optimizer when the update is "
            f"elementwise. Supported: torch.optim.{', torch.optim.'.join(ELEMENTWISE)}. If yours is elementwise "
            f"(no per-tensor norms, factored or matrix states), pass elementwise_ok=True")


class _LossScaler:
    """fp16 dynamic loss scaling: halve on overflow (and skip the step), double after `window` good steps."""

    def __init__(self, enabled: bool, scale: float, window: int, min_scale: float):
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.window = window
        self.min_scale = min_scale
        self.good = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2, self.min_scale)
            self.good = 0
            self.skipped += 1
            log.info("fp16 overflow: step skipped, loss scale now %g", self.scale)
        else:
            self.good += 1
            if self.good >= self.window:
                self.scale *= 2
                self.good = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        if self.enabled:
            self.scale, self.good, self.skipped = d["scale"], d["good"], d["skipped"]


@dataclass(frozen=True)
class OptimizerStats:
    """What Zero3Optimizer.step() did, as of one call to Zero3Optimizer.stats(). The hooks' own counters
    (gathers, prefetch, reductions) are in ``opt.coordinator.stats()``; the store's bytes moved per tier in
    ``opt.store.stats()``."""

    steps: int  # steps taken (a step skipped for an fp16 overflow is not one); a loaded checkpoint sets it
    overflow_skips: int  # fp16 steps skipped because a gradient overflowed (the scale halved each time); checkpointed
    loss_scale: float  # the current fp16 loss scale (1.0 without fp16 loss scaling)
    quantized_states: int  # optimizer states (one per sub-group and state, e.g. exp_avg) held in 8 bits now
    fused_steps: int  # sub-group steps done by the fused 8-bit AdamW kernel ([Note: fused 8-bit step in ZeRO-3])
    # sub-group steps on this rank that left some of its elements alone, their parameters having had no gradient
    # ([Note: skipped parameters])
    partly_skipped: int
    # bytes read from / written to the nvme tier since construction, by kind ("params", "grads", "master",
    # "states"; 8-bit states as stored) -- [Note: disk bytes by kind] in disk_bytes.py
    disk_read: dict[str, int]
    disk_written: dict[str, int]
    overlapped: int  # sub-group steps done during backward ([Note: overlapped step])
    # sub-group steps that took the master backward had read from nvme instead of reading it again ([Note: masters
    # at hand] in stepper.py)
    masters_at_hand: int
    # masters the forward took from the step that wrote them instead of reading them ([Note: stepped masters kept
    # for the forward] in stepper.py)
    masters_kept: int


class Zero3Optimizer(torch.optim.Optimizer):
    """ZeRO-3 over a torch optimizer class. See [Note: thin wrapper over an elementwise optimizer].

    model: the nn.Module (its parameters are partitioned and hooked; tied parameters once).
    optimizer_class: e.g. torch.optim.AdamW; `**optimizer_kwargs` go to it (lr, betas, weight_decay ...).
    param_groups: optional [{"params": [names or parameters], **overrides}, ...]; trainable parameters not
        listed join the first group. Frozen parameters (requires_grad=False) are partitioned, never stepped.
    config: OffloadConfig (default: params on the device tier, states and gradients on host).
    process_group: the data-parallel group (default: the whole world when torch.distributed is initialised).
    """

    def __init__(self, model: torch.nn.Module, optimizer_class, *, config: OffloadConfig | dict | None = None,
                 param_groups: list[dict] | None = None, process_group=None, elementwise_ok: bool = False,
                 **optimizer_kwargs):
        try:  # a failed construction takes back what it did ([Note: a failed construction] in release.py)
            self._build(model, optimizer_class, config, param_groups, process_group, elementwise_ok, optimizer_kwargs)
        except BaseException:
            release.abandon(self)
            raise

    def _build(self, model: torch.nn.Module, optimizer_class, config: OffloadConfig | dict | None,
               param_groups: list[dict] | None, process_group, elementwise_ok: bool, optimizer_kwargs: dict) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TierstoreValueError(f"model must be the nn.Module to partition; got {type(model).__name__}. "
                                      f"Zero3Optimizer needs the module to install its gather/release hooks")
        registry.check_unowned(model)  # [Note: one optimizer per model] in registry.py
        _check_elementwise(optimizer_class, elementwise_ok)
        self.config = config = OffloadConfig.coerce(config)
        self.model = model
        self.group = process_group
        self.world_size, self.rank = _dist.world_and_rank(process_group)
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = dict(optimizer_kwargs)
        cdt = config.compute_dtype
        # -- parameters: canonical names (tied once), values, compute dtype ------------------------------
        self._params: dict[str, torch.nn.Parameter] = {}
        self._aliases: dict[str, str] = {}  # every name in model.named_parameters(remove_duplicate=False)
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in by_id:
                self._aliases[name] = by_id[id(p)]
                continue
            by_id[id(p)] = name
            self._aliases[name] = name
            self._params[name] = p
        if not self._params:
            raise TierstoreValueError("the model has no parameters to optimize")
        devices = {p.device for p in self._params.values() if p.device.type != "meta"}
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        shapes = {}
        for name, p in self._params.items():
            handle = getattr(p, "_tierstore_init", None)
            if handle is not None:
                handle.unwrap(p)  # a plain Parameter again: the optimizer takes it ([Note: when a module is offloaded])
            shape = tuple(handle.shape) if handle is not None else tuple(p.shape)
            if not (p.dtype.is_floating_point or handle is not None):
                raise TierstoreValueError(f"parameter {name!r} has dtype {p.dtype}; ZeRO-3 manages floating-point "
                                          f"parameters only")
            shapes[name] = shape
        groups = self._normalise_groups(param_groups, by_id)
        validate.optimizer_arguments(optimizer_class, optimizer_kwargs, [o for _n, o in groups], self.device)
        self.layout = Layout([(n, shapes[n], cdt, p.requires_grad) for n, p in self._params.items()], groups,
                             self.world_size, min_io_bytes=config.min_io_bytes, bucket_bytes=config.sub_group_bytes)
        # -- the store --------------------------------------------------------------------------------
        self._tmpdir, act_paths = None, None
        if config.nvme_paths:  # [Note: scratch directories are marked] in scratch.py
            paths, act_paths = scratch.claim_optimizer_dirs(config.nvme_paths, self.rank,
                                                            activations=config.activation_offload == "nvme")
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="tierstore-zero-")
            paths = [self._tmpdir]
        tiers = {config.params, config.optimizer_states, config.gradients}
        # starts empty (a previous run's states are not this run's) once it locked every directory (else MisuseError)
        self.store = Store(paths, budgets={"device": None if "device" in tiers else 0,
                                           "host": None if "host" in tiers else 0, "pinned": config.pinned_bytes},
                           device=self.device, io_tuning=config.io_tuning, _fresh=True)
        for _n, b in model.named_buffers():
            if b.is_floating_point() and b.dtype != cdt:
                b.data = b.data.to(cdt)
        policy = None
        if config.state_codec == "dynamic8":
            from ..quant.states import StatePolicy
            policy = StatePolicy.make()
        # [Note: shared master] With fp32 compute and parameters on the same tier as the optimizer states,
        # the parameter shard would be a byte-for-byte copy of the master: the master is gathered instead,
        # and the step writes one tensor, not two.
        self._shared_master = cdt == torch.float32 and config.params == config.optimizer_states
        # -- shards -----------------------------------------------------------------------------------
        self._fill_shards()
        # -- inner optimizer over placeholders --------------------------------------------------------
        self._placeholder: dict[int, torch.Tensor] = {}
        inner_groups = []
        self._gid_group: dict[int, int] = {}
        for gl in self.layout.groups:
            if not gl.trainable:
                continue
            phs = []
            for gid in gl.gids:
                ph = torch.empty(0, dtype=torch.float32, device=self.device)
                self._placeholder[gid] = ph
                self._gid_group[gid] = gl.index
                phs.append(ph)
            inner_groups.append({"params": phs, **gl.options})
        self.inner = optimizer_class(inner_groups, **optimizer_kwargs)
        self.inner.state.clear()  # eager states of 0-element placeholders; real ones come from _templates
        self._templates = [self._state_template(optimizer_class, g, optimizer_kwargs) for g in inner_groups]
        self._constructing = True
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self._constructing = False
        self.param_groups = self.inner.param_groups  # the same dicts: LR schedulers drive the inner optimizer
        self._clip_coef = 1.0
        self._clipped = False  # clip_grad_norm_ called since the last step (then config.gradient_clipping waits)
        self._scaler = _LossScaler(cdt == torch.float16, config.initial_loss_scale, config.loss_scale_window,
                                   config.min_loss_scale)
        # -- the step's parts: buffers, 8-bit states, skipped parameters, the sub-group stepper ------------
        buffers = BufferPool(self.device, 2 * config.pipeline_depth,  # [Note: lent buffers are bounded] in stepper.py
                             lend_bytes=2 * config.pipeline_depth * config.sub_group_bytes)
        self._disk = DiskBytes(self.store)  # [Note: disk bytes by kind]
        # threads of the (de)quantization kernels on the pipeline's helper threads: None = the kernel's own
        # default (all cores). One thread each, to leave the compute its cores, made 8-bit steps slower
        # (bench/README.md, "Why the code is as it is").
        self._states8 = EightBitStates(self.store, config.optimizer_states, policy, buffers, nthreads=None)
        self._skipped = SkippedParams(self.layout, self.rank, optimizer_class, self.optimizer_kwargs,
                                      self.inner.param_groups, self._templates, self.device)
        fused8 = policy is not None and tier_info(config.optimizer_states).holds_encoded_bytes and fused8_capable(
            optimizer_class, self.inner.param_groups, self.device)
        self._stepper = SubgroupStepper(self.store, config, self.inner, self._placeholder, self._gid_group,
                                        self._templates, self._states8, self._skipped, buffers,
                                        shard_numel=self.layout.shard_numel, shared_master=self._shared_master,
                                        fused8=fused8, device=self.device, disk=self._disk)
        # [Note: persistent gradient partitions] in grad_partitions.py
        self._grads = GradPartitions(self.store, config.gradients, self.layout, buffers, self._disk,
                                     dtype=config.gradient_dtype)  # [Note: gradient dtype on nvme]
        # norms read at every step: the fp16 overflow check, clipping with the previous norm
        self._grads.eager = cdt == torch.float16 or config.clip_mode == "previous_norm"
        self.steps = 0
        # why this optimizer may not be used: a load_checkpoint failed after it had begun importing
        # ([Note: a failed load changes nothing] in ckpt_verify.py); None: usable
        self.unusable: str | None = None
        clip.register(self)  # [Note: clipping through torch's functions]
        self.coordinator = ParamCoordinator(
            model, self.layout, self._params, self._fetch_param_shard, self._grads, device=self.device,
            group=process_group, quantized_weights=config.quantized_weights and self.world_size > 1,
            quantized_gradients=config.quantized_gradients and self.world_size > 1,
            intra_node_size=config.intra_node_size, prefetch_depth=config.prefetch_depth,
            prefetch_bytes=config.prefetch_bytes,
            reuse_bytes=config.reuse_budget, lend_shard=None if config.overlap_step else self._lend_param_shard)
        self.hpz = Hpz.attach(self.coordinator, config.hpz_partition_size, params_tier=config.params)  # or None
        # [Note: masters at hand] in stepper.py: backward's gathered masters read from nvme, kept for the step
        if (self._shared_master and self.world_size == 1 and not tier_info(config.optimizer_states).memory
                and config.reuse_budget > 0):
            self.coordinator.on_backward_release = self._offer_master
        # [Note: stepped masters kept for the forward] in stepper.py: the step's masters, kept for the forward
        self._head: tuple[list[int] | None, frozenset[int]] = (None, frozenset())  # _forward_head()'s cache
        if self._shared_master and not tier_info(config.optimizer_states).memory and config.reuse_budget > 0:
            self._stepper.keep_for_forward = self._forward_head
        # [Note: a partitioned model's state dict] in module_state.py: model.state_dict() / load_state_dict()
        self.module_state = ModuleState(model, self.layout, self._params, self.coordinator, self._fetch_param_shard,
                                        self._read_master, self._write_master, device=self.device, group=process_group)
        self._grads.before_open = self._check_not_clipped
    # [Note: overlapped step]
        self._next_clip: tuple[float, float] | None = None  # clip_mode="previous_norm": (max_norm, norm) of the
        self._prev_clip: tuple[float, float] | None = None  # last clip_grad_norm_; ... of the one before this step
        self._accumulating = 0
        self._overlapped = 0  # sub-group steps done during backward (OptimizerStats)
        self._stream: StepStream | None = None
        self._final_backwards_seen = 0  # coordinator.final_backwards at the last zero_grad()
        if config.overlap_step:
            st = self._stepper
            self._stream = StepStream(config.pipeline_depth, lambda it: st.load(it[0], self._grads.take(it[0])),
                                      lambda it, t: st.step_loaded([t], it[1])[0], lambda it, t: st.save(t),
                                      queue_bytes=config.pipeline_depth * config.sub_group_bytes)
            self.coordinator.on_final = self._step_final
        self.activations = None  # tierstore.ActivationOffload when config.activation_offload is set
        if config.activation_offload is not None:
            from ..activations import ActivationOffload
            self.activations = ActivationOffload(
                config.activation_offload, paths=act_paths, mode=config.activation_mode,
                budget_bytes=config.activation_budget_bytes, compress=config.activation_compress)
            self.activations.attach(self.coordinator)
        for gid in range(len(self.layout.subgroups)):
            self.coordinator.release(gid)
        for _name, p in self._params.items():
            self.coordinator.residency.empty_param(_name, cdt)  # [Note: partitioned parameters read true]
            if hasattr(p, "_tierstore_init"):
                p._tierstore_init.discard()
                del p._tierstore_init
        # [Note: model.zero_grad() forgets the partitions] code that zeroes through the model (transformers'
        # Trainer calls model.zero_grad(), never optimizer.zero_grad()) must not leave this step's gradient in
        # the partitions, where the next backward would add to it: the model's zero_grad forgets them too.
        self._model_zero_grad = functools.partial(_zero_model_and_partitions, model.zero_grad, weakref.ref(self))
        model.zero_grad = self._model_zero_grad  # type: ignore[method-assign]  # an instance attribute

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructing", False):
            return super().add_param_group(param_group)
        raise MisuseError("Zero3Optimizer partitions its parameters when it is built; add_param_group cannot "
                          "add more later. Pass every group with param_groups=[...] to the constructor")

    # -- construction helpers ---------------------------------------------------------------------------
    def _normalise_groups(self, param_groups, by_id) -> list[tuple[list[str], dict]]:
        if param_groups is None:
            return [([], {})]
        if not isinstance(param_groups, (list, tuple)) or not param_groups:
            raise TierstoreValueError("param_groups must be a non-empty list of dicts with a 'params' key")
        out = []
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise TierstoreValueError(f"param_groups[{i}] must be a dict with a 'params' key")
            names = []
            for p in g["params"]:
                if isinstance(p, str):
                    names.append(self._aliases.get(p, p))
                elif isinstance(p, torch.Tensor) and id(p) in by_id:
                    names.append(by_id[id(p)])
                else:
                    raise TierstoreValueError(f"param_groups[{i}]['params'] holds {type(p).__name__}; give "
                                              f"parameter names or the model's parameters")
            out.append((names, {k: v for k, v in g.items() if k != "params"}))
        return out

    @staticmethod
    def _state_template(cls, group: dict, kwargs: dict) -> dict:
        """What the inner optimizer puts in a fresh parameter's state at construction (Adagrad's sum), learnt
        on a 1-element tensor: 1-element tensors become fill values, 0-d tensors and others are copied."""
        probe = torch.zeros(1)
        opts = {k: v for k, v in group.items() if k != "params"}
        tmp = cls([{"params": [probe], **opts}], **kwargs)
        return dict(tmp.state.get(probe, {}))

    def _take_range(self, name: str, a: int, b: int, out: torch.Tensor, *, sliced: bool) -> None:
        """out (fp32, b - a elements) <- flattened elements [a, b) of parameter `name` that this rank supplies:
        what its zero.Init handle holds, else the in-memory value -- all of it, or (sliced=True: the bucket is
        summed over ranks) only this rank's even slice, so that every element comes from exactly one rank."""
        p = self._params[name]
        handle = getattr(p, "_tierstore_init", None)
        if handle is not None:
            handle.take(a, b, out)
            return
        if sliced:
            from .init import even_slice
            lo, hi = even_slice(p.numel(), self.world_size, self.rank)
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                out[a2 - a:b2 - a].copy_(p.detach().reshape(-1)[a2:b2])
            return
        out.copy_(p.detach().reshape(-1)[a:b])

    def _init_sliced_gids(self) -> set[int]:
        """Sub-groups holding a parameter built under zero.Init at world size > 1 (their shards come from a
        reduce-scatter), agreed by every rank; refuses handles of another world size or rank on every rank at
        once (one rank raising alone would leave the others in the collective). See [Note: streaming Init at
        world size N] in init.py."""
        problem = None
        for name, p in self._params.items():
            h = getattr(p, "_tierstore_init", None)
            if h is not None and (h.world, h.rank) != (self.world_size, self.rank):
                problem = (f"parameter {name!r} was built under tierstore.zero.Init at world size {h.world} (rank "
                           f"{h.rank}), but this Zero3Optimizer's group has world size {self.world_size} (rank "
                           f"{self.rank}). Under Init each rank keeps only its slice of every parameter, so only "
                           f"the same group can reassemble it: initialise torch.distributed before entering Init "
                           f"and pass the same process_group to Init and Zero3Optimizer")
                break
        gids = len(self.layout.subgroups)
        mine = torch.zeros(gids, dtype=torch.int32)
        for gid in range(gids):
            if any(getattr(getattr(self._params[pc.name], "_tierstore_init", None), "sliced", False)
                   for pc in self.layout.bucket(gid).pieces):
                mine[gid] = 1
        if self.world_size == 1:
            if problem:
                raise TierstoreValueError(problem)
            return set()
        flags = torch.cat([torch.tensor([int(problem is not None)], dtype=torch.int32), mine, 1 - mine])
        _dist.all_reduce_max(flags, self.group)  # [any rank refused, any rank sliced, any rank not sliced]
        if problem:
            raise TierstoreValueError(problem)
        if flags[0]:
            raise TierstoreValueError("another rank refused a parameter built under tierstore.zero.Init (world "
                                      "size or rank differs from this Zero3Optimizer's group; its error says which)")
        mixed = [gid for gid in range(gids) if flags[1 + gid] and flags[1 + gids + gid]]
        if mixed:
            names = [pc.name for pc in self.layout.bucket(mixed[0]).pieces]
            raise TierstoreValueError(f"some ranks built parameters {names[:3]} under tierstore.zero.Init and "
                                      f"others did not; every rank must build the same model the same way")
        return {gid for gid in range(gids) if flags[1 + gid]}

    def _fill_shards(self) -> None:
        """Cut this rank's shards, one bucket at a time, from the parameters' values or their zero.Init
        handles (whose chunks are deleted as they are taken). At world size N a bucket of Init slices is
        filled with what this rank holds and reduce-scattered; see [Note: streaming Init at world size N]."""
        from .init import reduce_scatter_exact
        cfg = self.config
        sliced = self._init_sliced_gids()
        for gl in self.layout.groups:
            for bi, b in enumerate(gl.plan.buckets):
                gid = gl.gids[bi]
                # sliced: the whole bucket, zero bits where other ranks supply the value; else this shard
                lo, hi = (0, b.numel) if gid in sliced else (b.shard_slice(self.rank).start,
                                                               b.shard_slice(self.rank).stop)
                buf = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
                for pc, start, stop in b.overlapping(lo, hi):
                    at = pc.param_offset + start - pc.offset
                    self._take_range(pc.name, at, at + stop - start, buf[start - lo:stop - lo],
                                     sliced=gid in sliced)
                master = reduce_scatter_exact(buf, self.group) if gid in sliced else buf
                del buf
                if gl.trainable:
                    self.store.put(keys.master(gid), master, tier=cfg.optimizer_states)
                if not (gl.trainable and self._shared_master):
                    self.store.put(keys.param(gid), master.to(cfg.compute_dtype), tier=cfg.params)
                del master

    # -- store access --------------------------------------------------------------------------------------
    def _lend_param_shard(self, gid: int):
        """The store's own copy of `gid`'s parameter shard when it is on a memory tier on the compute device,
        held (resident) until the returned function is called; None otherwise ([Note: gathering at world
        size 1] in hooks.py)."""
        if self._shared_master and self.layout.group_of(gid).trainable:
            name, tier = keys.master(gid), self.config.optimizer_states
        else:
            name, tier = keys.param(gid), self.config.params
        t = self.store.tensor(name)
        if not tier_info(tier).memory or tier not in t.tiers or t.dtype != self.layout.bucket(gid).dtype:
            return None
        cm = t.resident(tier)
        x = cm.__enter__()
        if x.device != self.device or not x.is_contiguous():
            cm.__exit__(None, None, None)
            return None
        return x, lambda: cm.__exit__(None, None, None)

    def _read_master(self, gid: int) -> torch.Tensor:
        """This rank's shard of sub-group `gid` in fp32 (a copy): the master, or a frozen sub-group's shard."""
        if self.layout.group_of(gid).trainable:
            return self.store.get(keys.master(gid))
        return self.store.get(keys.param(gid)).to(torch.float32)

    def _write_master(self, gid: int, master: torch.Tensor) -> None:
        """Replace this rank's shard of sub-group `gid` (fp32 values): master and compute-dtype shard."""
        cfg = self.config
        self._stepper.drop_at_hand()
        self._stepper.drop_kept()
        trainable = self.layout.group_of(gid).trainable
        if trainable:
            self.store.put(keys.master(gid), master, tier=cfg.optimizer_states)
        if not (trainable and self._shared_master):
            self.store.put(keys.param(gid), master.to(cfg.compute_dtype), tier=cfg.params)

    def _fetch_param_shard(self, gid: int) -> torch.Tensor:
        if self._shared_master and self.layout.group_of(gid).trainable:
            kept = self._stepper.take_kept(gid)  # [Note: stepped masters kept for the forward] in stepper.py
            if kept is not None:
                return kept
            name = keys.master(gid)
        else:
            name = keys.param(gid)
        shard = self.store.get(name)
        self._disk.count(name, write=False, kind="params")
        return shard

    def _check_not_clipped(self) -> None:
        """Before a gradient is reduced into a partition: refuse one that arrives after a pending clip."""
        if self._clip_coef != 1.0:  # [Note: clipping through torch's functions] in clip.py
            raise MisuseError("a gradient arrived after the gradients were clipped (clip_grad_norm_) and before "
                              "step(): the clip is applied inside the step, to every gradient, so it would scale "
                              "this one too. Clip once, after the last backward before step()")

    # -- the step ------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale (1 unless compute_dtype is float16): call backward on this."""
        return loss * self._scaler.scale if self._scaler.enabled else loss

    def backward(self, loss: torch.Tensor) -> None:
        """scale_loss(loss).backward()."""
        self.scale_loss(loss).backward()

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def stats(self) -> OptimizerStats:
        """A snapshot of the step's counters (see OptimizerStats)."""
        return OptimizerStats(steps=self.steps, overflow_skips=self._scaler.skipped, loss_scale=self._scaler.scale,
                              quantized_states=len(self._states8.packed), fused_steps=self._stepper.fused_steps,
                              partly_skipped=self._skipped.partly_skipped,
                              disk_read={k: self._disk.read[k] for k in KINDS},
                              disk_written={k: self._disk.written[k] for k in KINDS}, overlapped=self._overlapped,
                              masters_at_hand=self._stepper.masters_at_hand,
                              masters_kept=self._stepper.masters_kept)

    def _global_grad_stats(self) -> tuple[float, bool]:
        sq, bad = self._grads.sum_squares()
        t = torch.tensor([sq if math.isfinite(sq) else 0.0, float(bad)], dtype=torch.float64)
        _dist.all_reduce_sum(t, self.group)
        return float(t[0]), bool(t[1] > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients (all ranks, all sub-groups) to global L2 norm `max_norm` at the next step();
        returns the total norm before clipping (unscaled; a clip already pending counted), like
        torch.nn.utils.clip_grad_norm_ -- which routes here for this optimizer's parameters ([Note: clipping
        through torch's functions] in clip.py). Call it after the last backward before step(). Collective. With
        OffloadConfig(clip_mode="previous_norm") the norm is kept for the step after the next one ([Note:
        overlapped step])."""
        if float(norm_type) != 2.0:
            raise TierstoreValueError(f"norm_type={norm_type}: only the L2 norm (2.0) is supported")
        previous = self.config.clip_mode == "previous_norm"
        if self._overlap_spent() and not previous:
            raise MisuseError("clip_grad_norm_ after a backward that already stepped sub-groups "
                              "(OffloadConfig(overlap_step=True)): their step cannot be clipped any more. Use "
                              "OffloadConfig(clip_mode='previous_norm') to clip overlapped steps with the previous "
                              "step's norm, or overlap_step=False for exact clipping")
        sq, overflow = self._global_grad_stats()
        total = math.sqrt(sq) / self._scaler.scale * self._clip_coef
        if overflow:
            total = float("inf")
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               f"non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               f"by the non-finite norm anyway, set `error_if_nonfinite=False`")
        norm = torch.tensor(total)  # float32, as torch's clip_grad_norm_ returns it
        # previous_norm: the next step clips with the norm this returns, so that the user's own arithmetic on it
        # (as the tests' reference does) gives the same coefficient to the last bit
        self._clip_with_norm(max_norm, float(norm) if previous else total)
        self._clipped = True
        return norm

    def clip_grads_with_norm_(self, max_norm: float, total_norm) -> None:
        """Scale the gradients by min(1, max_norm / (total_norm + 1e-6)) at the next step() (what
        torch.nn.utils.clip_grads_with_norm_ does, routed here for this optimizer's parameters)."""
        self._clip_with_norm(max_norm, float(total_norm))

    def _clip_with_norm(self, max_norm: float, total: float) -> None:
        if self.config.clip_mode == "previous_norm":  # [Note: overlapped step]
            self._next_clip = (max_norm, total)
        elif math.isfinite(total):
            self._clip_coef *= min(1.0, max_norm / (total + 1e-6))

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element of this rank's partitions to [-clip_value, clip_value] now (exact: the
        partition holds the reduced gradient; the fp16 loss scale and a pending norm clip are accounted for).
        torch.nn.utils.clip_grad_value_ routes here for this optimizer's parameters."""
        if self._overlap_spent():
            raise MisuseError("clip_grad_value_ after a backward that already stepped sub-groups "
                              "(OffloadConfig(overlap_step=True)): their gradients are spent. Use overlap_step=False "
                              "to clip by value")
        self._grads.clamp_(float(clip_value) * self._scaler.scale / self._clip_coef)

    def _overlap_spent(self) -> bool:
        """A backward since zero_grad() ended with the overlapped step on: sub-groups may have been stepped --
        the same answer on every rank, which the set of sub-groups stepped is not (a collective refused on one
        rank alone would leave the others waiting in it)."""
        return bool(self._grads.stepped) or self.coordinator.final_backwards != self._final_backwards_seen

    def managed_param_ids(self) -> frozenset[int]:
        """id() of every parameter this optimizer partitions (tied ones once; frozen ones included)."""
        return frozenset(id(p) for p in self._params.values())

    def trainable_param_ids(self) -> frozenset[int]:
        """id() of every trainable parameter this optimizer partitions."""
        return frozenset(id(p) for p in self._params.values() if p.requires_grad)

    # [Note: overlapped step]
    # With OffloadConfig(overlap_step=True), a sub-group whose gradient is final -- world size 1: every trainable
    # parameter of its bucket has its gradient for this backward and the bucket is reduced; world size N: see [Note:
    # overlapped step at world size N] -- is stepped right away: the coordinator hands it over (``on_final``) and
    # StepStream (pipeline.py) loads its master and states on a reader thread, steps it on a compute thread and
    # writes it back on a writer thread while backward goes on; on nvme its gradient partition goes from the
    # reduction straight to the step, never to the disk ([Note: persistent gradient partitions] in
    # grad_partitions.py). ``step()`` waits for them and steps what backward left (some parameter of the bucket
    # without a gradient, a bucket still held by a running forward); a bucket whose gradient becomes final in the
    # end-of-backward reductions is handed over there, so its step overlaps the reductions after it. Only the
    # backward of the last micro-batch steps: one run inside ``with opt.accumulating():`` only accumulates.
    # What it changes: a step needs every clipping or overflow decision before the sub-groups are stepped, so
    # float16 (the loss scaler) is refused, exact clipping after an overlapped backward raises, and
    # clip_mode="previous_norm" clips every step with the max_norm and global norm of the clip_grad_norm_ call of
    # the step before (the first step is not clipped) -- exact when nothing is clipped. A sub-group that receives
    # gradient after it was stepped (a parameter shared by two reentrant checkpointed regions) raises instead of
    # being stepped twice. The parameters are gathered as copies in this mode (no lent shards, [Note: gathering at
    # world size 1] in hooks.py), so what autograd saved in forward keeps the values the forward used. Not covered:
    # a parameter gathered again later in the same backward after its gradient is final (a use that takes no
    # gradient, on demand) reads the stepped value -- keep overlap_step off for such a model.
    #
    # [Note: overlapped step at world size N]
    # At world size N a bucket is reduce-scattered during backward when the agreed schedule says so ([Note: gradient
    # reduce-scatter] in gradient_reducer.py) -- complete on this rank or not: a rank whose gradient for it is not
    # all in yet marks it dirty when the rest arrives, and every rank reduces it again at the end. So "reduced here"
    # is not "final": this rank cannot know alone whether another will add to it. At each visit that reduces buckets
    # with overlap_step on, the coordinator posts one small all_reduce MAX of a flag per bucket -- 1 where this rank
    # cannot step it now (its gradient not complete here, or its values held, or not gathered in this backward, so a
    # later visit could read the shard) -- and keeps the partitions aside (on nvme in their buffers, handed over).
    # At the next visit (or the end of backward) it reads the result: a bucket no rank flagged is final everywhere
    # and stepped at once on the stream, the others' partitions are stored as without overlap and step() steps them
    # (CoordinatorStats. finals_deferred). The decision is the same on every rank; so must be the use of
    # ``accumulating()`` (it decides whether the flags are posted at all), as every rank's backward calls must match
    # anyway. With gloo the wait costs at most the other ranks' arrival at that visit, which its all-gathers wait
    # for anyway; with a backend that reduces only on the device (NCCL) the coordinator reads the flags only once
    # the collective completed, never syncing the device (not run here: no GPU). At the end of backward, after the
    # agreement on dirty buckets, every reduction is final: each bucket reduced there with a gradient for every
    # parameter (on some rank) and not used by a forward running is handed over as soon as it is reduced. The
    # first backward (no schedule yet) therefore steps its sub-groups during the end-of-backward reductions,
    # later ones during backward proper.
    # Clipping: clip_mode="previous_norm" takes the global norm as without overlap (clip_grad_norm_: an all_reduce
    # of the ranks' sums of squares, taken when each partition was at hand) after backward; with
    # OffloadConfig.gradient_clipping, step() posts it before it waits for the sub-groups stepping, so it runs
    # meanwhile. Exact clipping after a backward that ran with overlap is refused on every rank alike (not only on
    # those that stepped something): one rank raising alone would leave the others in the collective. Which
    # parameters got no gradient is only agreed at the end of backward; a bucket stepped earlier had a gradient for
    # every parameter on every rank, so no parameter of it is skipped ([Note: skipped parameters] in skipped.py).

    def _offer_master(self, gid: int, full: torch.Tensor) -> None:
        """The coordinator released bucket `gid` in backward: hand its values to the step when they are
        exactly the master's and nothing else refers to them ([Note: masters at hand] in stepper.py)."""
        if (not self.layout.group_of(gid).trainable or full.dtype != torch.float32 or not full.is_contiguous()
                or full.numel() != self.layout.shard_numel(gid) or full.device != self.device):
            return
        # `full`, the untyped storage asked here and `full`'s base (an aligned allocation) if it is a view; a
        # view saved by autograd would be one more
        if torch._C._storage_Use_Count(full.untyped_storage()._cdata) > 2 + (full._base is not None):
            return
        budget = self.config.reuse_budget
        if self._stream is not None:  # also kept while their sub-groups wait in the stream's queue
            budget += self._stream.queue_bytes  # ([Note: the stream's queue is in bytes] in pipeline.py)
        self._stepper.offer(gid, full, budget)

    def _forward_head(self) -> frozenset[int]:
        """The trainable sub-groups the next forward uses first, as many as fit in min(reuse_bytes,
        prefetch_bytes) (their fp32 shards): the step keeps their masters for it ([Note: stepped masters kept
        for the forward])."""
        order = self.coordinator.forward_order()
        if self._head[0] is not order:
            budget, head = min(self.config.reuse_budget, self.config.prefetch_bytes), []
            for gid in order:
                if not self.layout.group_of(gid).trainable:
                    continue
                nbytes = 4 * self.layout.shard_numel(gid)
                if nbytes > budget:
                    break
                budget -= nbytes
                head.append(gid)
            self._head = (order, frozenset(head))
        return self._head[1]

    def _step_final(self, gid: int) -> None:
        """The coordinator's on_final: step sub-group `gid` now, on the stream."""
        self.check_usable("step")
        self._grads.stepped.add(gid)
        self._overlapped += 1
        nbytes = 4 * self.layout.shard_numel(gid)  # its fp32 master here ([Note: the stream's queue is in bytes])
        self._stream.submit((gid, self._step_coef()), nbytes)  # type: ignore[union-attr]  # set with on_final

    def _step_coef(self) -> float:
        """What this step multiplies the gradients by (clipping, loss scale)."""
        if self.config.clip_mode == "previous_norm":
            if self._prev_clip is None:
                return 1.0 / self._scaler.scale
            max_norm, total = self._prev_clip
            return (min(1.0, max_norm / (total + 1e-6)) if math.isfinite(total) else 1.0) / self._scaler.scale
        return self._clip_coef / self._scaler.scale

    @contextmanager
    def accumulating(self):
        """`with opt.accumulating(): loss.backward()` -- a micro-batch that is not the last of the step: its
        backward only accumulates gradients, even with OffloadConfig(overlap_step=True) ([Note: overlapped
        step]). Without overlap_step every backward only accumulates anyway."""
        self._accumulating += 1
        self.coordinator.on_final = None
        try:
            yield
        finally:
            self._accumulating -= 1
            if self._accumulating == 0 and self._stream is not None:
                self.coordinator.on_final = self._step_final

    @torch.no_grad()
    def step(self, closure=None):
        self.check_usable("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = self._grads.stepped
        if self._stream is not None:
            if self.config.gradient_clipping and not self._clipped and self._grads:  # clip_mode="previous_norm"
                # this step's global norm, for the next one: its all_reduce runs while the overlapped steps end
                self.clip_grad_norm_(self.config.gradient_clipping)
            self._stream.wait()  # the sub-groups stepped during backward ([Note: overlapped step])
        if not self._grads:  # no backward since zero_grad(): like torch, nothing to do
            return loss
        if self._scaler.enabled:
            _sq, overflow = self._global_grad_stats()
            if overflow:
                self._scaler.update(True)
                self._clip_coef = 1.0
                self.zero_grad()
                return loss
        if self.config.gradient_clipping and not self._clipped:  # DeepSpeed's gradient_clipping
            self.clip_grad_norm_(self.config.gradient_clipping)
        coef = self._step_coef()
        # [Note: skipped parameters] in skipped.py: only sub-groups some parameter of which got a gradient
        plan = self._skipped.plan(self.coordinator.grad_names)
        try:
            self._stepper.step([g for g in plan if g not in stepped], coef)
        finally:
            self._skipped.runs = {}  # this step's: an overlapped step of the next one must not see them
            self._stepper.drop_at_hand()  # [Note: masters at hand]: the masters changed
        self._scaler.update(False)
        self._clip_coef = 1.0
        self._prev_clip, self._next_clip = self._next_clip, None
        self._clipped = False
        self.steps += 1
        self.coordinator.prefetch_forward()  # [Note: prefetch after the step] in prefetch.py
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradient partitions (and any full .grad left on the model)."""
        if self._stream is not None:
            self._stream.wait()  # nothing may still be stepping what is forgotten
        self._grads.clear()  # the partitions' memory is kept ([Note: persistent gradient partitions])
        self._final_backwards_seen = self.coordinator.final_backwards
        self._stepper.drop_at_hand()
        self._clip_coef = 1.0
        self._clipped = False
        self.coordinator.clear_grad_flags()
        for p in self._params.values():
            p.grad = None

    # -- full parameters ---------------------------------------------------------------------------------
    @contextmanager
    def gathered(self, params=None, *, modifier_rank: int | None = None):
        """`with opt.gathered():` every parameter of the model (or those in `params`) holds its full value
        (collective: every rank enters, with the same parameters). modifier_rank=r: on exit rank r's values
        are broadcast and written into every rank's shards and fp32 masters, so changes made inside are kept;
        None (default): changes are dropped (evaluation, export). See [Note: gathered parameters] in
        gathered.py."""
        if params is None:
            names = list(self._params)
        else:
            by_id = {id(p): n for n, p in self._params.items()}
            given = [params] if isinstance(params, torch.Tensor) else list(params)
            foreign = [p for p in given if id(p) not in by_id]
            if foreign:
                raise TierstoreValueError(f"gathered(params=...): {len(foreign)} of the parameters given are not "
                                          f"managed by this Zero3Optimizer")
            names = list(dict.fromkeys(by_id[id(p)] for p in given))
        self.check_usable("gathered")
        self.module_state.check_idle("gathered()")
        self.coordinator.release_kept()  # values it changes must not reach a kept bucket ([Note: kept at the turn])
        self._stepper.drop_at_hand()
        gids = sorted({g for n in names for g in self.layout.param_gids[n]})
        before = set(self.coordinator.residency.live)
        self.coordinator.views = False  # copies: changes made inside stay there ([Note: gathering at world size 1])
        try:
            self.coordinator.gather(gids)
        finally:
            self.coordinator.views = True
        ok = False
        try:
            yield self.model
            ok = True
        finally:
            try:
                if ok and modifier_rank is not None:
                    values = {}
                    for n in names:
                        v = self._params[n].data
                        if self.world_size > 1:
                            import torch.distributed as dist
                            src = dist.get_global_rank(self.group, modifier_rank) if self.group is not None \
                                else modifier_rank
                            dist.broadcast(v, src=src, group=self.group)
                        values[n] = v
                    with torch.no_grad():
                        self.module_state.load_into_shards(values)
            finally:
                for gid in gids:
                    if gid not in before:
                        self.coordinator.release(gid)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """name -> full parameter value (compute dtype, a CPU copy), every name of model.named_parameters()
        including tied aliases, plus the model's buffers. Collective; one bucket gathered at a time."""
        self.check_usable("full_state_dict")
        vals = self.module_state.gather_values(list(self._params))  # one bucket alive at a time; CPU tensors
        out = {alias: vals[canon] for alias, canon in self._aliases.items()}
        for n, b in self.model.named_buffers():
            out[n] = b.detach().clone()
        return out

    # -- the checkpoint interface ---------------------------------------------------------------------------
    # [Note: checkpoint interface]
    # What checkpoint.py (and state_dict / load_state_dict) read and write of the optimizer, in the optimizer's
    # terms -- sub-groups by global id, fp32 masters and states, hyperparameters, the loss scaler -- so that
    # the file format never reaches into its attributes. Public because checkpoint.py is another module, but
    # not a training API: a sub-group imported outside a load leaves the ranks' states inconsistent.

    def export_subgroup(self, gid: int) -> dict:
        """Trainable sub-group `gid`'s state on this rank, as CPU tensors: {"master": fp32 shard, "state":
        {key: fp32 tensor (8-bit states unpacked)}, "aux": {key: non-tensor state}}."""
        names = self._stepper.state_keys.get(gid, [])
        got = self.store.get_many([keys.master(gid)] + [keys.state(gid, k) for k in names], device="cpu")
        q8 = self._states8
        state = {}
        for k in names:
            v = got[keys.state(gid, k)]
            state[k] = q8.unpack(gid, k, v, torch.empty(q8.packed[(gid, k)][1])) if q8.is_packed(gid, k) else v
        return {"master": got[keys.master(gid)], "state": state, "aux": dict(self._stepper.aux.get(gid, {}))}

    def import_subgroup(self, gid: int, master: torch.Tensor, state: dict, aux: dict) -> None:
        """Replace trainable sub-group `gid`'s master shard (and parameter shard), states and aux state on
        this rank (what export_subgroup returns; `state` empty: a sub-group no step reached)."""
        cfg = self.config
        self.coordinator.prefetcher.drop()  # read ahead before this write ([Note: prefetch after the step])
        self._stepper.drop_at_hand()
        self._stepper.drop_kept()
        master = master.to(self.device, torch.float32)
        self.store.put(keys.master(gid), master, tier=cfg.optimizer_states)
        if not self._shared_master:
            self.store.put(keys.param(gid), master.to(cfg.compute_dtype), tier=cfg.params)
        state_keys = self._stepper.state_keys
        for k in state_keys.get(gid, []):
            if keys.state(gid, k) in self.store:
                self.store.delete(keys.state(gid, k))
            self._states8.forget(gid, k)  # put() below says again which of the new ones are packed
        for k, v in state.items():
            self._states8.put(gid, k, v.to(self.device))
        if state:
            state_keys[gid] = list(state)
        else:  # a sub-group no step reached: its states are created by its first step, as in a new run
            state_keys.pop(gid, None)
        self._stepper.aux[gid] = dict(aux)

    def check_usable(self, what: str) -> None:
        """MisuseError when a failed load_checkpoint left this optimizer unusable ([Note: a failed load changes
        nothing] in ckpt_verify.py)."""
        if self.unusable is not None:
            raise MisuseError(f"{what}: this Zero3Optimizer is unusable after a failed load_checkpoint (its "
                              f"sub-groups are partly from the checkpoint, partly from before): call "
                              f"load_checkpoint again or build a new Zero3Optimizer. The load failed with: "
                              f"{self.unusable}")

    def initial_state_values(self, gid: int) -> dict[str, float]:
        """Per-element state keys of sub-group `gid`'s parameter group and the value an element has before
        its first real step (what a resharded element no source sub-group stepped gets)."""
        return self._skipped.initial_state_values(self._gid_group[gid])

    def hyperparams(self) -> list[dict]:
        """Every parameter group's hyperparameters (lr, betas ...), without the parameters."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def set_hyperparams(self, groups: list[dict]) -> None:
        """Set what hyperparams() returned (one dict per parameter group, in order)."""
        if len(groups) != len(self.param_groups):
            raise TierstoreValueError(f"the state holds {len(groups)} parameter groups; this optimizer has "
                                      f"{len(self.param_groups)}")
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def scaler_state(self) -> dict:
        """The fp16 loss scaler's state (scale, good steps, skipped steps)."""
        return self._scaler.state_dict()

    def load_scaler_state(self, d: dict) -> None:
        self._scaler.load_state_dict(d)

    @property
    def param_aliases(self) -> dict[str, str]:
        """Every name in model.named_parameters(remove_duplicate=False) -> the canonical (first) name of its
        parameter (tied parameters are managed once, under that name)."""
        return dict(self._aliases)

    # -- state dicts -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state: hyperparameters, layout, and its shard of every master and state (CPU tensors).
        Load it with load_state_dict at the same world size and rank; to change either, use
        save_checkpoint / load_checkpoint, which reshard."""
        self.check_usable("state_dict")
        return {"format": STATE_FORMAT, "world_size": self.world_size, "rank": self.rank,
                "layout": self.layout.to_dict(), "param_groups": self.hyperparams(),
                "subgroups": {gid: self.export_subgroup(gid) for gid in self.layout.trainable_gids()},
                "scaler": self.scaler_state(), "steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.check_usable("load_state_dict")
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise TierstoreValueError("not a Zero3Optimizer state_dict (no 'format': "
                                      f"{STATE_FORMAT!r}); a plain torch optimizer's state cannot be loaded here")
        if (state_dict["world_size"], state_dict["rank"]) != (self.world_size, self.rank) or \
                state_dict["layout"] != self.layout.to_dict():
            raise TierstoreValueError(
                f"this state_dict is rank {state_dict['rank']} of {state_dict['world_size']} with another layout; "
                f"this optimizer is rank {self.rank} of {self.world_size}. Use opt.save_checkpoint(dir) / "
                f"opt.load_checkpoint(dir), which reshard across world sizes")
        self.set_hyperparams(state_dict["param_groups"])
        for gid, sg in state_dict["subgroups"].items():
            self.import_subgroup(int(gid), sg["master"], sg["state"], sg["aux"])
        self.load_scaler_state(state_dict["scaler"])
        self.steps = state_dict.get("steps", 0)
        self.coordinator.release_all()

    # -- checkpoints (see checkpoint.py) -------------------------------------------------------------------
    def save_checkpoint(self, directory: str | os.PathLike, **kwargs) -> str:
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, directory, **kwargs)

    def load_checkpoint(self, directory: str | os.PathLike, **kwargs):
        """Load the latest checkpoint; returns the client_state saved with it (None if none was)."""
        from .checkpoint import load_checkpoint
        return load_checkpoint(self, directory, **kwargs)

    def synchronize(self) -> None:
        """Wait for the I/O the last step left running: the next forward's parameter reads started after it
        ([Note: prefetch after the step]) and its writes in flight. For timing a step as a whole (as
        torch.cuda.synchronize before reading a clock); training does not need it. Nothing is made durable."""
        self.coordinator.prefetcher.settle()
        self.store.synchronize()

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks and close the store (its files stay unless they were in a temporary directory)."""
        if getattr(self, "store", None) is None:
            return
        if self.hpz is not None:
            self.hpz.remove()
        clip.unregister(self)
        release.restore_zero_grad(self)  # the class's own again
        self.coordinator.remove()
        self.module_state.remove()
        if self._stream is not None:
            self._stream.close()
        if self.activations is not None:
            self.activations.close()
        self._stepper.close()
        registry.mark_released(self._params.values(), repr(self))  # [Note: one optimizer per model]
        self.store.close(flush=False)
        self.store = None  # type: ignore[assignment]  # None marks it closed; a Store for as long as it is open
        # the checkpoint directories it writes pass on ([Note: one writer per checkpoint directory] in ckpt_dir.py)
        from .ckpt_dir import release as release_checkpoint_dirs
        release_checkpoint_dirs(self)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __repr__(self) -> str:
        return (f"Zero3Optimizer({self.optimizer_class.__name__}, rank {self.rank}/{self.world_size}, "
                f"{len(self.layout.subgroups)} sub-groups, params={self.config.params}, "
                f"states={self.config.optimizer_states}, grads={self.config.gradients})")
