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
since zero_grad() is not stepped: see [Note: skipped parameters].
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import tempfile
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..errors import MisuseError, TierstoreValueError
from ..store import Store
from ..tiers import tier_info
from . import _dist
from ._layout import Layout
from .config import OffloadConfig
from .hooks import ParamCoordinator
from .pipeline import StepPipeline

log = logging.getLogger("tierstore.zero")

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Rprop", "ASGD")
STATE_FORMAT = "tierstore.zero.optimizer/1"


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. Same-dtype contiguous CPU tensors go through one memmove: the pipeline's reader and writer
    threads then do not start OpenMP teams of their own next to the compute thread's (on a 2-core machine
    that oversubscription made a 2 MB copy_ take ~1-7 ms instead of ~0.2)."""
    if (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.is_contiguous()
            and src.is_contiguous() and dst.numel() == src.numel()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


def _numel(shape) -> int:  # elements
    return math.prod(shape)


def _fused8_capable(cls, groups: list[dict], device: torch.device) -> bool:
    """Whether every group of the inner optimizer computes what the native fused 8-bit AdamW kernel computes
    ([Note: fused 8-bit step in ZeRO-3]): torch.optim.AdamW itself (a subclass may change the update),
    without amsgrad (a third state), capturable or differentiable, on the CPU."""
    from ..quant import _native
    if cls is not torch.optim.AdamW or device.type != "cpu" or not _native.available():
        return False
    return all(not g.get("amsgrad") and not g.get("capturable") and not g.get("differentiable") for g in groups)


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


class Zero3Optimizer(torch.optim.Optimizer):
    """ZeRO-3 over a torch optimizer class. See [Note: thin wrapper over an elementwise optimizer].

    model: the nn.Module (its parameters are partitioned and hooked; tied parameters once).
    optimizer_class: e.g. torch.optim.AdamW; `**optimizer_kwargs` go to it (lr, betas, weight_decay ...).
    param_groups: optional [{"params": [names or parameters], **overrides}, ...]; trainable parameters not
        listed join the first group. Frozen parameters (requires_grad=False) are partitioned, never stepped.
    config: OffloadConfig (default: params on the device tier, states and gradients on host).
    process_group: the data-parallel group (default: the whole world when torch.distributed is initialised).
    """

    def __init__(self, model: torch.nn.Module, optimizer_class, *, config: OffloadConfig | None = None,
                 param_groups: list[dict] | None = None, process_group=None, elementwise_ok: bool = False,
                 **optimizer_kwargs):
        if not isinstance(model, torch.nn.Module):
            raise TierstoreValueError(f"model must be the nn.Module to partition; got {type(model).__name__}. "
                                      f"Zero3Optimizer needs the module to install its gather/release hooks")
        _check_elementwise(optimizer_class, elementwise_ok)
        self.config = config = config if config is not None else OffloadConfig()
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
            shape = tuple(handle.shape) if handle is not None else tuple(p.shape)
            if not (p.dtype.is_floating_point or handle is not None):
                raise TierstoreValueError(f"parameter {name!r} has dtype {p.dtype}; ZeRO-3 manages floating-point "
                                          f"parameters only")
            shapes[name] = shape
        groups = self._normalise_groups(param_groups, by_id)
        self.layout = Layout([(n, shapes[n], cdt, p.requires_grad) for n, p in self._params.items()], groups,
                             self.world_size, min_io_bytes=config.min_io_bytes, bucket_bytes=config.sub_group_bytes)
        for n, b in model.named_buffers():
            if b.is_floating_point() and b.dtype != cdt:
                b.data = b.data.to(cdt)
        # -- the store --------------------------------------------------------------------------------
        self._tmpdir = None
        if config.nvme_paths:
            paths = [os.path.join(p, f"rank{self.rank}") for p in config.nvme_paths]
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="tierstore-zero-")
            paths = [self._tmpdir]
        tiers = {config.params, config.optimizer_states, config.gradients}
        # A previous run's states are not this run's: the store starts empty (checkpoints live elsewhere). It
        # discards them itself, after it has locked every directory, so an optimizer started on directories
        # another one is using gets MisuseError and changes nothing.
        self.store = Store(paths, device_budget=None if "device" in tiers else 0,
                           host_budget=None if "host" in tiers else 0, pinned_budget=config.pinned_bytes,
                           device=self.device, _fresh=True)
        self._qs: dict[tuple[int, str], tuple[str, int]] = {}  # (gid, state) -> (scheme, elements) when 8-bit
        self._policy = None
        if config.state_codec == "dynamic8":
            from ..quant.states import StatePolicy
            self._policy = StatePolicy.make()
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
        self._state_keys: dict[int, list[str]] = {}
        self._aux: dict[int, dict] = {}
        self._grad_stats: dict[int, tuple[float, bool]] = {}  # gid -> (sum of squares, all finite)
        self._skip_runs: dict[int, list[tuple[int, int]]] = {}  # [Note: skipped parameters], for this step
        self._fresh: dict[int, dict[str, float]] = {}  # group -> _fresh_state
        self._clip_coef = 1.0
        self._scaler = _LossScaler(cdt == torch.float16, config.initial_loss_scale, config.loss_scale_window,
                                   config.min_loss_scale)
        self._pipeline = StepPipeline(config.pipeline_depth)
        self._inline = StepPipeline(1)  # nothing on nvme: the reads and writes are pointer moves, threads only cost
        self._free_bufs: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._buf_lock = threading.Lock()
        # threads of the (de)quantization kernels on the pipeline's helper threads: None = the kernel's own
        # default (all cores). One thread each was tried (to leave the compute its cores): 8-bit steps were
        # 10-25% slower on the 2-core development machine, so the default stays.
        self._qthreads = None
        self._fused8 = self._policy is not None and tier_info(config.optimizer_states).holds_encoded_bytes \
            and _fused8_capable(optimizer_class, self.inner.param_groups, self.device)
        self.steps = 0
        self._fused_steps = 0  # counters read through stats()
        self._partly_skipped = 0
        self.coordinator = ParamCoordinator(
            model, self.layout, self._params, self._fetch_param_shard, self._accumulate_grad, device=self.device,
            group=process_group, quantized_weights=config.quantized_weights and self.world_size > 1,
            quantized_gradients=config.quantized_gradients and self.world_size > 1,
            intra_node_size=config.intra_node_size, prefetch_depth=config.prefetch_depth)
        for gid in range(len(self.layout.subgroups)):
            self.coordinator.release(gid)
        for name, p in self._params.items():
            p.data = self.coordinator.empty(cdt)
            if hasattr(p, "_tierstore_init"):
                p._tierstore_init.discard()
                del p._tierstore_init

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
        try:
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
                        self.store.put(f"m{gid}", master, tier=cfg.optimizer_states)
                    if not (gl.trainable and self._shared_master):
                        self.store.put(f"p{gid}", master.to(cfg.compute_dtype), tier=cfg.params)
                    del master
        except BaseException:  # the constructor fails: leave no store (nor temporary directory) behind
            self.store.close(flush=False)
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise

    # -- store access --------------------------------------------------------------------------------------
    def _fetch_param_shard(self, gid: int) -> torch.Tensor:
        if self._shared_master and self.layout.group_of(gid).trainable:
            return self.store.get(f"m{gid}")
        return self.store.get(f"p{gid}")

    def _accumulate_grad(self, gid: int, shard: torch.Tensor) -> None:
        name = f"g{gid}"
        if gid in self._grad_stats and name in self.store:
            shard = self.store.get(name).add_(shard)
        self.store.put(name, shard, tier=self.config.gradients)
        sq = float(torch.linalg.vector_norm(shard, dtype=torch.float64) ** 2)
        self._grad_stats[gid] = (sq, math.isfinite(sq))

    # [Note: 8-bit states]
    # With state_codec="dynamic8" and states on nvme, exp_avg / exp_avg_sq of a sub-group (per
    # quant.states.StatePolicy: block 256, signed / unsigned dynamic maps, tiny tensors kept fp32) are stored
    # as one uint8 tensor in the packed layout ([Note: packed layout] in quant/packed.py: the fp32 absmax of
    # each block, then the codes).
    # The optimizer quantizes and dequantizes itself, into recycled buffers, on the reader / writer threads:
    # the store moves 1/4 of the bytes and no codec copies. Checkpoints and state_dict() hold fp32 states.

    def _scheme(self, gid: int, key: str, t: torch.Tensor) -> str | None:
        if self._policy is None or not tier_info(self.config.optimizer_states).holds_encoded_bytes or t.dim() != 1:
            return None
        return self._policy.scheme_for(key, t)

    def _packed_view(self, buf: torch.Tensor, scheme: str, n: int):
        from ..quant.quantized import Quantized
        return Quantized.packed(buf, scheme, n, self._policy.block_size)

    def _put_state(self, gid: int, key: str, v: torch.Tensor) -> None:
        name = f"s{gid}.{key}"
        scheme = self._scheme(gid, key, v)
        if scheme is None:
            self._qs.pop((gid, key), None)
            self.store.put(name, v, tier=self.config.optimizer_states)
            return
        from ..quant import packed
        from ..quant.quantized import quantize
        n = v.numel()
        buf = self._buffer(packed.nbytes(scheme, n, self._policy.block_size), torch.uint8)  # bytes
        with torch.profiler.record_function("tierstore::quantize_state"):
            quantize(v, scheme, self._policy.block_size, out=self._packed_view(buf, scheme, n), nthreads=self._qthreads)
        self.store.put(name, buf, tier=self.config.optimizer_states)
        self._qs[(gid, key)] = (scheme, n)
        self._recycle(buf)

    def _unpack_state(self, gid: int, key: str, buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        from ..quant.quantized import dequantize
        scheme, n = self._qs[(gid, key)]
        if out is None:
            out = self._buffer(n, torch.float32)
        with torch.profiler.record_function("tierstore::dequantize_state"):
            return dequantize(self._packed_view(buf, scheme, n), out=out, nthreads=self._qthreads)

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
                              quantized_states=len(self._qs), fused_steps=self._fused_steps,
                              partly_skipped=self._partly_skipped)

    def _global_grad_stats(self) -> tuple[float, bool]:
        sq = sum(s for s, _f in self._grad_stats.values())
        bad = sum(0 if f else 1 for _s, f in self._grad_stats.values())
        t = torch.tensor([sq if math.isfinite(sq) else 0.0, float(bad)], dtype=torch.float64)
        _dist.all_reduce_sum(t, self.group)
        return float(t[0]), bool(t[1] > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients (all ranks, all sub-groups) to global L2 norm `max_norm` at the next step();
        returns the total norm before clipping (unscaled), like torch.nn.utils.clip_grad_norm_."""
        if norm_type != 2.0:
            raise TierstoreValueError(f"norm_type={norm_type}: only the L2 norm (2.0) is supported")
        sq, overflow = self._global_grad_stats()
        total = math.sqrt(sq) / self._scaler.scale
        if overflow:
            total = float("inf")
        self._clip_coef = min(1.0, max_norm / (total + 1e-6)) if math.isfinite(total) else 1.0
        return torch.tensor(total)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grad_stats:  # no backward since zero_grad(): like torch, nothing to do
            return loss
        if self._scaler.enabled:
            _sq, overflow = self._global_grad_stats()
            if overflow:
                self._scaler.update(True)
                self._clip_coef = 1.0
                self.zero_grad()
                return loss
        coef = self._clip_coef / self._scaler.scale
        on_disk = any(tier_info(t).persistent for t in (self.config.optimizer_states, self.config.gradients)) or (
            tier_info(self.config.params).persistent and not self._shared_master)
        gids = self._gids_to_step()
        if (not on_disk and self.config.gradients == self.config.optimizer_states
                and all(gid in self._state_keys for gid in gids)):
            self._step_in_place(gids, coef)  # [Note: one inner step for memory tiers]
        else:
            (self._pipeline if on_disk else self._inline).run(gids, self._load_subgroup,
                                                              lambda gid, t: self._step_subgroup(gid, t, coef),
                                                              self._save_subgroup)
        self._scaler.update(False)
        self._clip_coef = 1.0
        self.steps += 1
        return loss

    # [Note: skipped parameters]
    # Like torch, a trainable parameter that got no gradient on any rank since zero_grad() is not stepped
    # (coordinator.grad_names, [Note: no gradient] in hooks.py). A sub-group (one bucket) none of whose
    # parameters got one is left out of the step. In a sub-group mixing both, the inner optimizer steps the
    # whole flat shard (zero gradient on the skipped elements), then the skipped elements of the master and of
    # every per-element state that existed before the step are put back: an elementwise update touches each
    # element on its own, so the rest is exactly what stepping only them gives. In a per-element state created
    # by this very step, the skipped elements get what one zero-gradient step makes of a fresh state on a zero
    # parameter (_fresh_state: 0 for Adam's moments and SGD's momentum, lr for Rprop's step size), not what
    # weight decay folded into their zero gradient would make of it; torch creates such a state at the
    # parameter's first real step instead -- the same values, except that SGD then starts that momentum at
    # (1 - dampening) x grad where torch starts it at grad (equal unless dampening != 0). Scalar states
    # (`step`, NAdam's mu_product, ASGD's eta and mu) stay per sub-group: a parameter skipped while the rest
    # of its sub-group stepped gets its bias corrections from the sub-group's count, not from a count of its
    # own as in torch (exact when it has a sub-group to itself, e.g. min_io_bytes=0). With 8-bit states such
    # a sub-group takes the unfused path, and requantizing moves the skipped elements' states by the codec's
    # rounding.

    def _fresh_state(self, gi: int) -> dict[str, float]:
        """Per-element state keys the inner optimizer creates lazily, and what one step with a zero gradient
        makes of them (learnt once per group on a zero 1-element probe): Adam's moments 0, SGD's momentum 0,
        Rprop's step size lr. A skipped element of a state created by this step gets that value."""
        if gi not in self._fresh:
            probe = torch.zeros(1, device=self.device)
            opts = {k: v for k, v in self.inner.param_groups[gi].items() if k != "params"}
            tmp = self.optimizer_class([{"params": [probe], **opts}], **self.optimizer_kwargs)
            probe.grad = torch.zeros(1, device=self.device)
            tmp.step()
            self._fresh[gi] = {k: float(v.reshape(-1)[0]) for k, v in tmp.state[probe].items()
                               if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 1}
        return self._fresh[gi]

    def _initial_state_values(self, gi: int) -> dict[str, float]:
        """Per-element state keys of group `gi` and the value an element has before its first real step: the
        eager initial state (Adagrad's sum) where the optimizer makes one, else _fresh_state's."""
        vals = dict(self._fresh_state(gi))
        for k, v in self._templates[gi].items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 1:
                vals[k] = float(v[0])
        return vals

    def _gids_to_step(self) -> list[int]:
        """The sub-groups to step, and this rank's runs of skipped elements in each ([Note: skipped
        parameters]); the same sub-groups on every rank (grad_names is agreed)."""
        got = self.coordinator.grad_names
        self._skip_runs = {}
        gids = []
        for gid in self.layout.trainable_gids():
            b = self.layout.bucket(gid)
            names = {pc.name for pc in b.pieces}
            if not names & got:
                continue
            gids.append(gid)
            if names <= got:
                continue
            lo, hi = b.shard_slice(self.rank).start, b.shard_slice(self.rank).stop
            runs: list[tuple[int, int]] = []
            for pc, start, stop in b.overlapping(lo, hi):
                if pc.name in got:
                    continue
                if runs and runs[-1][1] == start - lo:
                    runs[-1] = (runs[-1][0], stop - lo)
                else:
                    runs.append((start - lo, stop - lo))
            if runs:
                self._skip_runs[gid] = runs
        self._partly_skipped += len(self._skip_runs)
        return gids

    # [Note: in place on memory tiers]
    # A sub-group whose tensors live on a memory tier (device/host) is stepped on the tier's own copies:
    # the load enters ``resident(tier, writeback=True)`` for each (no copy, pinned against eviction), the
    # inner optimizer updates master and states in place, and the save leaves the blocks (on the writer
    # thread). Only tensors on the nvme tier are read into buffers -- recycled between sub-groups, so the
    # step allocates (and page-faults) nothing in steady state -- and written back with put().

    def _on_memory(self, name: str, tier: str) -> bool:
        return tier_info(tier).memory and tier in self.store.tensor(name).tiers

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._buf_lock:
            free = self._free_bufs.get((numel, dtype))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def _recycle(self, t: torch.Tensor) -> None:
        with self._buf_lock:
            free = self._free_bufs.setdefault((t.numel(), t.dtype), [])
            if len(free) < 2 * self.config.pipeline_depth:
                free.append(t)

    def _load_subgroup(self, gid: int) -> dict:
        cfg = self.config
        keys = self._state_keys.get(gid, [])
        roles = [("master", f"m{gid}", cfg.optimizer_states), ("grad", f"g{gid}", cfg.gradients)]
        roles += [(k, f"s{gid}.{k}", cfg.optimizer_states) for k in keys]
        stack = ExitStack()
        got: dict[str, torch.Tensor] = {}
        resident: set[str] = set()
        disk: list[tuple[str, str]] = []
        try:
            for role, name, tier in roles:
                if self._on_memory(name, tier):
                    got[role] = stack.enter_context(self.store.tensor(name).resident(tier, writeback=True))
                    resident.add(role)
                else:
                    disk.append((role, name))
            if disk:
                outs = []
                for role, name in disk:
                    t = self.store.tensor(name)
                    outs.append(self._buffer(_numel(t.shape), t.dtype).view(t.shape))
                read = self.store.get_many([n for _r, n in disk], out=outs)
                fused = self._fused8_for(gid)
                for (role, name), o in zip(disk, outs):
                    got[role] = read[name]
                    if role not in ("master", "grad") and (gid, role) in self._qs and not fused:
                        got[role] = self._unpack_state(gid, role, o)
                        self._recycle(o)
        except BaseException:
            stack.close()
            raise
        return {"got": got, "resident": resident, "stack": stack, "keys": keys, "fused": bool(disk) and fused}

    def _step_subgroup(self, gid: int, t: dict, coef: float):
        return self._step_subgroups([(gid, t)], coef)[0]

    def _step_subgroups(self, items: list[tuple[int, dict]], coef: float) -> list[dict]:
        """Step the loaded sub-groups `items` [(gid, loaded)] with one inner.step() over their placeholders
        (the fused 8-bit ones with the native kernel); each loaded dict gains "new_state" and "master_out"."""
        staged = []
        kept: dict[int, list] = {}  # id(placeholder) -> [(state key or None for the master, start, stop, values)]
        stepped = False
        try:
            for gid, t in items:
                got = t["got"]
                master = got["master"]
                grad = got["grad"]
                if grad.device != master.device:
                    grad = grad.to(master.device)
                if coef != 1.0:
                    grad.mul_(coef)
                if t["fused"]:
                    self._step_fused8(gid, t, master, grad)
                    self._fused_steps += 1
                    continue
                ph = self._placeholder[gid]
                ph.data = master
                ph.grad = grad
                staged.append((t, ph))
                state = {k: got[k] for k in t["keys"]}
                state.update(self._aux.get(gid, {}))
                if not state:
                    n = master.numel()
                    for k, v in self._templates[self._gid_group[gid]].items():
                        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 1:
                            state[k] = torch.full((n,), float(v[0]), dtype=v.dtype, device=master.device)
                        elif isinstance(v, torch.Tensor):
                            state[k] = v.clone()
                        else:
                            state[k] = v
                if state:
                    self.inner.state[ph] = state
                runs = self._skip_runs.get(gid)
                if runs:  # [Note: skipped parameters]
                    n = master.numel()
                    per_element = [(None, master)] + [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)
                                                      and v.dim() == 1 and v.numel() == n]
                    kept[id(ph)] = [(k, a, e, v[a:e].clone()) for k, v in per_element for a, e in runs]
                    kept[id(ph)] += [(k, a, e, fill) for k, fill in self._fresh_state(self._gid_group[gid]).items()
                                     if k not in state for a, e in runs]
            if staged:
                self.inner.step()
            stepped = True
        except BaseException:
            for _gid, t in items:
                t["stack"].close()
            raise
        finally:
            for t, ph in staged:
                t["new_state"] = self.inner.state.pop(ph, {})
                t["master_out"] = ph.data
                for k, a, e, values in kept.get(id(ph), ()) if stepped else ():
                    dst = ph.data if k is None else t["new_state"].get(k)
                    if isinstance(values, float):  # a state created by this step: its fresh value
                        if isinstance(dst, torch.Tensor) and dst.dim() == 1 and dst.numel() == ph.data.numel():
                            dst[a:e].fill_(values)
                    else:
                        dst[a:e].copy_(values)
                ph.data = torch.empty(0, dtype=torch.float32, device=self.device)
                ph.grad = None
        return [t for _gid, t in items]

    # [Note: one inner step for memory tiers]
    # With nothing on nvme there is no I/O to overlap, and stepping sub-group by sub-group costs one inner
    # optimizer call each: torch's fused CPU AdamW forks an OpenMP team per call, so 8 calls over 2M elements
    # measured 19.2 ms where one call over the same 8 tensors took 16.6 (bench optim, development machine).
    # Once every sub-group has its states (after the first step, which creates them one sub-group at a time so
    # their temporaries never exist all at once) and the gradients sit on the states' tier (no copy of the
    # whole gradient partition to another device), the step enters every sub-group's tensors in place
    # (resident, no copies) and calls inner.step() once over all placeholders: the same elementwise
    # arithmetic, one call.

    def _step_in_place(self, gids: list[int], coef: float) -> None:
        loaded: list[tuple[int, dict]] = []
        try:
            for gid in gids:
                loaded.append((gid, self._load_subgroup(gid)))
            self._step_subgroups(loaded, coef)
        except BaseException:
            for _gid, t in loaded:
                t["stack"].close()
            raise
        saved = 0
        try:
            for gid, t in loaded:
                saved += 1
                self._save_subgroup(gid, t)
        finally:
            for _gid, t in loaded[saved:]:
                t["stack"].close()

    # [Note: fused 8-bit step in ZeRO-3]
    # With AdamW over 8-bit states on nvme, unpacking exp_avg / exp_avg_sq to fp32 on the reader thread,
    # stepping, and packing them again on the writer thread costs about 11.7 ms of CPU per 2M-element sub-group
    # on the development machine, more than twice the fused native kernel of quant.states ([Note: fused 8-bit
    # step] there: decode, update, encode per block of 256 in one pass), 5.1 ms (`tierstore bench quant
    # --numel 2097152 --blocks 256 --schemes dyn8s,dyn8v --no-torch-reference`: "reference path" vs "fused
    # kernel"). So, when the inner optimizer is AdamW in a form that kernel computes (see _fused8_capable) and a
    # sub-group's two moments are both 8-bit, the packed buffers read from the store are stepped in place and
    # written back as they are. The arithmetic is torch's fused CPU AdamW element by element (up to the 1-ulp
    # lerp difference documented there), whichever AdamW implementation (foreach / fused / single-tensor)
    # the user picked; the unfused path below stays for every other case (the first step, which creates
    # the states; fp32 states of small sub-groups; any other optimizer).

    def _fused8_for(self, gid: int) -> bool:
        """Whether sub-group `gid` is stepped by the fused 8-bit kernel ([Note: fused 8-bit step in ZeRO-3])."""
        if not self._fused8 or gid in self._skip_runs:  # skipped elements need the unfused path
            return False
        from ..quant.schemes import fused_adamw_pair
        keys = self._state_keys.get(gid, ())
        m, v = self._qs.get((gid, "exp_avg")), self._qs.get((gid, "exp_avg_sq"))
        return "step" in keys and m is not None and v is not None and fused_adamw_pair(m[0], v[0])

    def _step_fused8(self, gid: int, t: dict, master: torch.Tensor, grad: torch.Tensor) -> dict:
        from ..quant import _native
        got = t["got"]
        group = self.inner.param_groups[self._gid_group[gid]]
        m = self._packed_view(got["exp_avg"], *self._qs[(gid, "exp_avg")])
        v = self._packed_view(got["exp_avg_sq"], *self._qs[(gid, "exp_avg_sq")])
        step = got["step"]
        step += 1
        beta1, beta2 = group["betas"]
        try:
            with torch.profiler.record_function("tierstore::adamw_step_8bit"):
                _native.adamw_step(master, grad.contiguous(), m.codes, m.absmax, v.codes, v.absmax, m.block_size,
                                   v.scheme, step=float(step), lr=float(group["lr"]), beta1=float(beta1),
                                   beta2=float(beta2), eps=float(group["eps"]),
                                   weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]),
                                   nthreads=self._qthreads, m_scheme=m.scheme)
        except BaseException:
            t["stack"].close()
            raise
        t["new_state"] = {k: got[k] for k in t["keys"]}
        t["master_out"] = master
        return t

    def _save_subgroup(self, gid: int, t: dict) -> None:
        cfg = self.config
        got, resident = t["got"], t["resident"]
        try:
            master = t["master_out"]
            if "master" not in resident or master.data_ptr() != got["master"].data_ptr():
                self.store.put(f"m{gid}", master, tier=cfg.optimizer_states)
            pname = f"p{gid}"
            if self._shared_master:
                pass
            elif self._on_memory(pname, cfg.params):
                with self.store.tensor(pname).resident(cfg.params, writeback=True) as p:
                    _copy(p, master)
            else:
                self.store.put(pname, master.to(cfg.compute_dtype), tier=cfg.params)
            keys, aux = [], {}
            for k, v in t["new_state"].items():
                if isinstance(v, torch.Tensor):
                    same = k in resident and got[k].data_ptr() == v.data_ptr()
                    if t["fused"] and (gid, k) in self._qs:  # still packed: the fused step updated the codes
                        self.store.put(f"s{gid}.{k}", v, tier=cfg.optimizer_states)
                    elif not same:
                        self._put_state(gid, k, v)
                    keys.append(k)
                else:
                    aux[k] = v
            self._state_keys[gid] = keys
            self._aux[gid] = aux
        finally:
            t["stack"].close()
            for role, v in got.items():
                if role not in resident:
                    self._recycle(v)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradient partitions (and any full .grad left on the model)."""
        for gid in list(self._grad_stats):
            if f"g{gid}" in self.store:
                self.store.delete(f"g{gid}")
        self._grad_stats.clear()
        self._clip_coef = 1.0
        self.coordinator.clear_grad_flags()
        for p in self._params.values():
            p.grad = None

    # -- full parameters ---------------------------------------------------------------------------------
    @contextmanager
    def gathered(self):
        """`with opt.gathered():` every parameter of the model holds its full value (collective: every
        rank enters). Changes made inside are not written back; use for evaluation or export."""
        self.coordinator.gather(range(len(self.layout.subgroups)))
        try:
            yield self.model
        finally:
            self.coordinator.release_all()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """name -> full parameter value (compute dtype, a copy), every name of model.named_parameters()
        including tied aliases, plus the model's buffers. Collective."""
        with self.gathered():
            vals = {n: p.detach().clone() for n, p in self._params.items()}
        out = {alias: vals[canon] for alias, canon in self._aliases.items()}
        for n, b in self.model.named_buffers():
            out[n] = b.detach().clone()
        return out

    # -- state dicts -------------------------------------------------------------------------------------
    def _export_subgroup(self, gid: int) -> dict:
        keys = self._state_keys.get(gid, [])
        got = self.store.get_many([f"m{gid}"] + [f"s{gid}.{k}" for k in keys], device="cpu")
        state = {}
        for k in keys:
            v = got[f"s{gid}.{k}"]
            state[k] = self._unpack_state(gid, k, v, torch.empty(self._qs[(gid, k)][1])) if (gid, k) in self._qs else v
        return {"master": got[f"m{gid}"], "state": state, "aux": dict(self._aux.get(gid, {}))}

    def _import_subgroup(self, gid: int, master: torch.Tensor, state: dict, aux: dict) -> None:
        cfg = self.config
        master = master.to(self.device, torch.float32)
        self.store.put(f"m{gid}", master, tier=cfg.optimizer_states)
        if not self._shared_master:
            self.store.put(f"p{gid}", master.to(cfg.compute_dtype), tier=cfg.params)
        for k in self._state_keys.get(gid, []):
            if f"s{gid}.{k}" in self.store:
                self.store.delete(f"s{gid}.{k}")
        for k, v in state.items():
            self._put_state(gid, k, v.to(self.device))
        if state:
            self._state_keys[gid] = list(state)
        else:  # a sub-group no step reached: its states are created by its first step, as in a new run
            self._state_keys.pop(gid, None)
        self._aux[gid] = dict(aux)

    def _hyperparams(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _set_hyperparams(self, groups: list[dict]) -> None:
        if len(groups) != len(self.param_groups):
            raise TierstoreValueError(f"the state holds {len(groups)} parameter groups; this optimizer has "
                                      f"{len(self.param_groups)}")
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def state_dict(self) -> dict:
        """This rank's state: hyperparameters, layout, and its shard of every master and state (CPU tensors).
        Load it with load_state_dict at the same world size and rank; to change either, use
        save_checkpoint / load_checkpoint, which reshard."""
        return {"format": STATE_FORMAT, "world_size": self.world_size, "rank": self.rank,
                "layout": self.layout.to_dict(), "param_groups": self._hyperparams(),
                "subgroups": {gid: self._export_subgroup(gid) for gid in self.layout.trainable_gids()},
                "scaler": self._scaler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise TierstoreValueError("not a Zero3Optimizer state_dict (no 'format': "
                                      f"{STATE_FORMAT!r}); a plain torch optimizer's state cannot be loaded here")
        if (state_dict["world_size"], state_dict["rank"]) != (self.world_size, self.rank) or \
                state_dict["layout"] != self.layout.to_dict():
            raise TierstoreValueError(
                f"this state_dict is rank {state_dict['rank']} of {state_dict['world_size']} with another layout; "
                f"this optimizer is rank {self.rank} of {self.world_size}. Use opt.save_checkpoint(dir) / "
                f"opt.load_checkpoint(dir), which reshard across world sizes")
        self._set_hyperparams(state_dict["param_groups"])
        for gid, sg in state_dict["subgroups"].items():
            self._import_subgroup(int(gid), sg["master"], sg["state"], sg["aux"])
        self._scaler.load_state_dict(state_dict["scaler"])
        self.steps = state_dict.get("steps", 0)
        self.coordinator.release_all()

    # -- checkpoints (see checkpoint.py) -------------------------------------------------------------------
    def save_checkpoint(self, directory: str | os.PathLike, **kwargs) -> str:
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, directory, **kwargs)

    def load_checkpoint(self, directory: str | os.PathLike, **kwargs) -> None:
        from .checkpoint import load_checkpoint
        load_checkpoint(self, directory, **kwargs)

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks and close the store (its files stay unless they were in a temporary directory)."""
        if getattr(self, "store", None) is None:
            return
        self.coordinator.remove()
        self._pipeline.close()
        self.store.close(flush=False)
        self.store = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __repr__(self) -> str:
        return (f"Zero3Optimizer({self.optimizer_class.__name__}, rank {self.rank}/{self.world_size}, "
                f"{len(self.layout.subgroups)} sub-groups, params={self.config.params}, "
                f"states={self.config.optimizer_states}, grads={self.config.gradients})")
