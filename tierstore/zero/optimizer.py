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
parameter, gradient and states, and on scalars (lr, step count) -- so an allow-list is checked and
anything else is refused (inner.py): a factored (Adafactor) or line-search (LBFGS) update over a flat shard
would silently be a different optimizer.
As in torch (and unlike DeepSpeed, which steps it with a zero gradient), a parameter that got no gradient
since zero_grad() is not stepped: see [Note: skipped parameters] in skipped.py.

The optimizer is an assembly of the wings' parts: the hooks (hooks/), the step (step/: shards, inner optimizer,
stepper, 8-bit states, gradient partitions, scaling, the overlapped step), the model's parameters (params/);
the speed features hear the hooks' events ([Note: hook events] in events.py); checkpoint/ uses the interface
of [Note: checkpoint interface] below.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref
from contextlib import nullcontext

import torch

from ..errors import MisuseError, TierstoreValueError
from ..store import Store
from . import _dist, release, scratch, validate
from .checkpoint import rank_state
from .config import OffloadConfig
from .hooks.coordinator import ParamCoordinator
from .hooks.events import Subscribers
from .hooks.hpz import Hpz
from .params import full_values, registry
from .params.layout import Layout
from .params.module_state import ModuleState
from .step import clip
from .step.disk_bytes import KINDS
from .step.grad_partitions import GradPartitions
from .step.inner import build_inner, check_elementwise, normalise_groups
from .step.overlap import OverlappedStep, overlap_mode
from .step.scaling import GradScaling
from .step.shards import ModelShards, model_params, param_shapes
from .step.stats import OptimizerStats
from .step.stepper import StepContext, SubgroupStepper


def _zero_model_and_partitions(model_zero_grad, opt_ref, set_to_none: bool = True) -> None:
    """model.zero_grad() of a model under a Zero3Optimizer ([Note: model.zero_grad() forgets the partitions]);
    the optimizer is held weakly (the model must not keep it, and its store, alive)."""
    model_zero_grad(set_to_none)
    opt = opt_ref()
    if opt is not None and getattr(opt, "store", None) is not None:
        opt.zero_grad(set_to_none)


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
        check_elementwise(optimizer_class, elementwise_ok)
        self.config = cfg = OffloadConfig.coerce(config)
        self.model, self.group, self.optimizer_class = model, process_group, optimizer_class
        self.world_size, self.rank = _dist.world_and_rank(process_group)
        self.optimizer_kwargs, cdt = dict(optimizer_kwargs), cfg.compute_dtype
        # -- parameters (canonical names, tied once) and their layout ----------------------------------------
        self._params, self._aliases, by_id, self.device = model_params(model)
        shapes = param_shapes(self._params)
        groups = normalise_groups(param_groups, self._aliases, by_id)
        validate.optimizer_arguments(optimizer_class, optimizer_kwargs, [o for _n, o in groups], self.device)
        self.layout = Layout([(n, shapes[n], cdt, p.requires_grad) for n, p in self._params.items()], groups,
                             self.world_size, min_io_bytes=cfg.min_io_bytes, bucket_bytes=cfg.sub_group_bytes)
        act_paths = self._open_store()
        for _n, b in model.named_buffers():
            if b.is_floating_point() and b.dtype != cdt:
                b.data = b.data.to(cdt)
        # -- the step: inner optimizer over placeholders, 8-bit states, skipped parameters, the stepper -------
        self.inner, placeholder, gid_group, templates = build_inner(self.layout, optimizer_class,
                                                                   optimizer_kwargs, self.device)
        self._constructing = True
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self._constructing = False
        self.param_groups = self.inner.param_groups  # the same dicts: LR schedulers drive the inner optimizer
        self._stepper = SubgroupStepper(StepContext.build(self.store, cfg, self.layout, self.inner, placeholder,
                                                          gid_group, templates, self.optimizer_kwargs, self.rank,
                                                          self.device))
        # -- the model's shards, cut into the store ([Note: shared master] in shards.py) ----------------------
        self.shards = ModelShards(self.store, cfg, self.layout, self._params, stepper=self._stepper,
                                  disk=self._stepper.disk, device=self.device, group=process_group,
                                  world_size=self.world_size, rank=self.rank)
        self.shards.fill()
        # -- gradients, the hooks and the speed features on their events ([Note: hook events] in events.py) ---
        events = Subscribers()
        self._grads = GradPartitions(self.store, cfg.gradients, self.layout, self._stepper.buffers,
                                     self._stepper.disk, dtype=cfg.gradient_dtype, events=events)
        self.overlap: OverlappedStep | None = None  # [Note: overlapped step] in overlap.py
        self.scaling = GradScaling(cfg, self._grads, process_group,
                                   lambda: self.overlap is not None and self.overlap.spent())
        self.steps = 0
        # why this optimizer may not be used: a load_checkpoint failed after it had begun importing
        # ([Note: a failed load changes nothing] in checkpoint/verify.py); None: usable
        self.unusable: str | None = None
        clip.register(self)  # [Note: clipping through torch's functions]
        overlap = overlap_mode(cfg, self.device)  # [Note: the overlapped step by default] in overlap.py
        self.coordinator = ParamCoordinator(
            model, self.layout, self._params, self.shards.fetch, self._grads, device=self.device,
            group=process_group, quantized_weights=cfg.quantized_weights and self.world_size > 1,
            quantized_gradients=cfg.quantized_gradients and self.world_size > 1,
            intra_node_size=cfg.intra_node_size, prefetch_depth=cfg.prefetch_depth, prefetch_bytes=cfg.prefetch_bytes,
            reuse_bytes=cfg.reuse_budget, lend_shard=None if overlap == "on" else self.shards.lend, events=events)
        self.hpz = Hpz.attach(self.coordinator, cfg.hpz_partition_size, params_tier=cfg.params)  # or None
        # [Note: a partitioned model's state dict] in module_state.py: model.state_dict() / load_state_dict()
        self.module_state = ModuleState(model, self.layout, self._params, self.coordinator, self.shards.fetch,
                                        self.shards.read_master, self.shards.write_master, device=self.device,
                                        group=process_group)
        self.coordinator.subscribe(self.scaling)  # refuses a gradient after a pending clip
        if overlap != "off":
            self.overlap = OverlappedStep(cfg, self._stepper, self._grads, self.layout, self.coordinator,
                                          self.scaling.step_coef, self.check_usable, overlap, process_group)
        self.shards.listen(self.coordinator, self.overlap.stream.queue_bytes if self.overlap is not None else 0)
        self.activations = None  # tierstore.ActivationOffload when config.activation_offload is set
        if cfg.activation_offload is not None:
            from ..activations import ActivationOffload
            self.activations = ActivationOffload(
                cfg.activation_offload, paths=act_paths, mode=cfg.activation_mode,
                budget_bytes=cfg.activation_budget_bytes, compress=cfg.activation_compress)
            self.activations.attach(self.coordinator)
        self.shards.hand_to(self.coordinator)  # the parameters are empty from here on
        # [Note: model.zero_grad() forgets the partitions] code that zeroes through the model (transformers'
        # Trainer calls model.zero_grad(), never optimizer.zero_grad()) must not leave this step's gradient in
        # the partitions, where the next backward would add to it: the model's zero_grad forgets them too.
        self._model_zero_grad = functools.partial(_zero_model_and_partitions, model.zero_grad, weakref.ref(self))
        model.zero_grad = self._model_zero_grad  # type: ignore[method-assign]  # an instance attribute

    def _open_store(self) -> list[str] | None:
        """Open the store on the scratch directories (or a temporary one); returns the activations' paths."""
        cfg = self.config
        self._tmpdir, act_paths = None, None
        if cfg.nvme_paths:  # [Note: scratch directories are marked] in scratch.py
            paths, act_paths = scratch.claim_optimizer_dirs(cfg.nvme_paths, self.rank,
                                                            activations=cfg.activation_offload == "nvme")
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="tierstore-zero-")
            paths = [self._tmpdir]
        tiers = {cfg.params, cfg.optimizer_states, cfg.gradients}
        # starts empty (a previous run's states are not this run's) once it locked every directory (else MisuseError)
        self.store = Store(paths, budgets={"device": None if "device" in tiers else 0,
                                           "host": None if "host" in tiers else 0, "pinned": cfg.pinned_bytes},
                           device=self.device, io_tuning=cfg.io_tuning, _fresh=True)
        return act_paths

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructing", False):
            return super().add_param_group(param_group)
        raise MisuseError("Zero3Optimizer partitions its parameters when it is built; add_param_group cannot "
                          "add more later. Pass every group with param_groups=[...] to the constructor")

    # -- the step ------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale (1 unless compute_dtype is float16): call backward on this."""
        return loss * self.scaling.scaler.scale if self.scaling.scaler.enabled else loss

    def backward(self, loss: torch.Tensor) -> None:
        """scale_loss(loss).backward()."""
        self.scale_loss(loss).backward()

    @property
    def loss_scale(self) -> float:
        return self.scaling.scaler.scale

    def stats(self) -> OptimizerStats:
        """A snapshot of the step's counters (see OptimizerStats)."""
        st, disk, scaler = self._stepper, self._stepper.disk, self.scaling.scaler
        return OptimizerStats(steps=self.steps, overflow_skips=scaler.skipped, loss_scale=scaler.scale,
                              quantized_states=len(st.states8.packed), fused_steps=st.fused_steps,
                              partly_skipped=st.skipped.partly_skipped,
                              disk_read={k: disk.read[k] for k in KINDS},
                              disk_written={k: disk.written[k] for k in KINDS},
                              overlapped=self.overlap.overlapped if self.overlap is not None else 0,
                              masters_at_hand=st.masters_at_hand, masters_kept=st.masters_kept,
                              step_paths=dict(sorted(st.paths.items())))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients (all ranks, all sub-groups) to global L2 norm `max_norm` at the next step();
        returns the total norm before clipping (unscaled; a clip already pending counted), like
        torch.nn.utils.clip_grad_norm_ -- which routes here for this optimizer's parameters ([Note: clipping
        through torch's functions] in clip.py). Call it after the last backward before step(). Collective. With
        OffloadConfig(clip_mode="previous_norm") the norm is kept for the step after the next one ([Note:
        overlapped step] in overlap.py)."""
        return self.scaling.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_grads_with_norm_(self, max_norm: float, total_norm) -> None:
        """Scale the gradients by min(1, max_norm / (total_norm + 1e-6)) at the next step() (what
        torch.nn.utils.clip_grads_with_norm_ does, routed here for this optimizer's parameters)."""
        self.scaling.clip_with_norm(max_norm, float(total_norm))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element of this rank's partitions to [-clip_value, clip_value] now (exact: the
        partition holds the reduced gradient; the fp16 loss scale and a pending norm clip are accounted for).
        torch.nn.utils.clip_grad_value_ routes here for this optimizer's parameters."""
        self.scaling.clip_grad_value_(clip_value)

    def managed_param_ids(self) -> frozenset[int]:
        """id() of every parameter this optimizer partitions (tied ones once; frozen ones included)."""
        return frozenset(id(p) for p in self._params.values())

    def trainable_param_ids(self) -> frozenset[int]:
        """id() of every trainable parameter this optimizer partitions."""
        return frozenset(id(p) for p in self._params.values() if p.requires_grad)

    def accumulating(self):
        """`with opt.accumulating(): loss.backward()` -- a micro-batch that is not the last of the step: its
        backward only accumulates gradients, even with OffloadConfig(overlap_step=True) ([Note: overlapped
        step] in overlap.py). Without overlap_step every backward only accumulates anyway."""
        return self.overlap.accumulating() if self.overlap is not None else nullcontext()

    @torch.no_grad()
    def step(self, closure=None):
        self.check_usable("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped, sc, clipping = self._grads.stepped, self.scaling, self.config.gradient_clipping
        if self.overlap is not None:
            if clipping and not sc.clipped and self._grads:  # clip_mode="previous_norm"
                # this step's global norm, for the next one: its all_reduce runs while the overlapped steps end
                sc.clip_grad_norm_(clipping)
            self.overlap.wait()  # the sub-groups stepped during backward ([Note: overlapped step] in overlap.py)
        if not self._grads:  # no backward since zero_grad(): like torch, nothing to do
            return loss
        if self.overlap is not None:
            self.overlap.observe(clipped=sc.touched, closure=closure is not None)
        if sc.overflowed():  # float16: the step is skipped ([Note: clipping with the loss scale] in scaling.py)
            self.zero_grad()
            return loss
        if clipping and not sc.clipped:  # DeepSpeed's gradient_clipping
            sc.clip_grad_norm_(clipping)
        coef = sc.step_coef()
        # [Note: skipped parameters] in skipped.py: only sub-groups some parameter of which got a gradient
        skipped = self._stepper.skipped
        plan = skipped.plan(self.coordinator.grad_names)
        try:
            self._stepper.step([g for g in plan if g not in stepped], coef)
        finally:
            skipped.runs = {}  # this step's: an overlapped step of the next one must not see them
            self._stepper.drop_at_hand()  # [Note: masters at hand] in stepper.py: the masters changed
        sc.stepped()
        self.steps += 1
        self.coordinator.prefetch_forward()  # [Note: prefetch after the step] in prefetch.py
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradient partitions (and any full .grad left on the model)."""
        if self.overlap is not None:
            self.overlap.zero_grad()  # nothing may still be stepping what is forgotten
        self._grads.clear()  # the partitions' memory is kept ([Note: persistent gradient partitions])
        self._stepper.drop_at_hand()
        self.scaling.zero_grad()
        self.coordinator.clear_grad_flags()
        for p in self._params.values():
            p.grad = None

    # -- full parameters (full_values.py) ---------------------------------------------------------------------
    def gathered(self, params=None, *, modifier_rank: int | None = None):
        """`with opt.gathered():` every parameter of the model (or those in `params`) holds its full value
        (collective: every rank enters, with the same parameters). modifier_rank=r: on exit rank r's values
        are broadcast and written into every rank's shards and fp32 masters, so changes made inside are kept;
        None (default): changes are dropped (evaluation, export). See [Note: gathered parameters] in
        gathered.py."""
        return full_values.gathered(self, params, modifier_rank=modifier_rank)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """name -> full parameter value (compute dtype, a CPU copy), every name of model.named_parameters()
        including tied aliases, plus the model's buffers. Collective; one bucket gathered at a time."""
        return full_values.full_state_dict(self)

    # -- the checkpoint interface ---------------------------------------------------------------------------
    # [Note: checkpoint interface]
    # What checkpoint/ (and state_dict / load_state_dict) read and write of the optimizer, in the optimizer's
    # terms -- sub-groups by global id, fp32 masters and states, hyperparameters, the loss scaler -- so that
    # the file format never reaches into its attributes. Public because checkpoint/ is another module, but
    # not a training API: a sub-group imported outside a load leaves the ranks' states inconsistent.

    def export_subgroup(self, gid: int) -> dict:
        """Trainable sub-group `gid`'s state on this rank, as CPU tensors: {"master": fp32 shard, "state":
        {key: fp32 tensor (8-bit states unpacked)}, "aux": {key: non-tensor state}}."""
        return self._stepper.export(gid)

    def import_subgroup(self, gid: int, master: torch.Tensor, state: dict, aux: dict) -> None:
        """Replace trainable sub-group `gid`'s master shard (and parameter shard), states and aux state on
        this rank (what export_subgroup returns; `state` empty: a sub-group no step reached)."""
        self.coordinator.prefetcher.drop()  # read ahead before this write ([Note: prefetch after the step])
        self._stepper.import_(gid, master, state, aux)

    def check_usable(self, what: str) -> None:
        """MisuseError when a failed load_checkpoint left this optimizer unusable ([Note: a failed load changes
        nothing] in checkpoint/verify.py)."""
        if self.unusable is not None:
            raise MisuseError(f"{what}: this Zero3Optimizer is unusable after a failed load_checkpoint (its "
                              f"sub-groups are partly from the checkpoint, partly from before): call "
                              f"load_checkpoint again or build a new Zero3Optimizer. The load failed with: "
                              f"{self.unusable}")

    def initial_state_values(self, gid: int) -> dict[str, float]:
        """Per-element state keys of sub-group `gid`'s parameter group and the value an element has before
        its first real step (what a resharded element no source sub-group stepped gets)."""
        return self._stepper.skipped.initial_state_values(self._stepper.gid_group[gid])

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
        return self.scaling.scaler.state_dict()

    def load_scaler_state(self, d: dict) -> None:
        self.scaling.scaler.load_state_dict(d)

    @property
    def param_aliases(self) -> dict[str, str]:
        """Every name in model.named_parameters(remove_duplicate=False) -> the canonical (first) name of its
        parameter (tied parameters are managed once, under that name)."""
        return dict(self._aliases)

    # -- state dicts (rank_state.py) -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state: hyperparameters, layout, and its shard of every master and state (CPU tensors).
        Load it with load_state_dict at the same world size and rank; to change either, use
        save_checkpoint / load_checkpoint, which reshard."""
        return rank_state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        rank_state.load_state_dict(self, state_dict)

    # -- checkpoints (see checkpoint/) -------------------------------------------------------------------
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
        if self.overlap is not None:
            self.overlap.close()
        if self.activations is not None:
            self.activations.close()
        self._stepper.close()
        registry.mark_released(self._params.values(), repr(self))  # [Note: one optimizer per model]
        self.store.close(flush=False)
        self.store = None  # type: ignore[assignment]  # None marks it closed; a Store for as long as it is open
        # its checkpoint directories pass on ([Note: one writer per checkpoint directory] in directory.py)
        from .checkpoint.directory import release as release_checkpoint_dirs
        release_checkpoint_dirs(self)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __repr__(self) -> str:
        return (f"Zero3Optimizer({self.optimizer_class.__name__}, rank {self.rank}/{self.world_size}, "
                f"{len(self.layout.subgroups)} sub-groups, params={self.config.params}, "
                f"states={self.config.optimizer_states}, grads={self.config.gradients})")
