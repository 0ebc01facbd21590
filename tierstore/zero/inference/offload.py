"""Offloaded inference: run a model's forward (eval loops, ``model.generate``, ``no_grad`` / ``inference_mode``)
with its weights on the host or nvme tier, gathered module by module, without an optimizer.

    with tierstore.zero.Init(OffloadConfig(params="nvme", nvme_paths=[d])):
        model = AutoModelForCausalLM.from_pretrained(name)       # streamed into the store, never in memory
    with tierstore.zero.offload_for_inference(model, tier="nvme", nvme_path=d, budget_bytes=256 << 20):
        out = model.generate(ids, max_new_tokens=20)

See docs/inference.md.

[Note: inference over the ZeRO-3 hooks]
Inference uses the training hooks as they are (hooks/coordinator.py's ``ParamCoordinator``): a module's forward
pre-hook gathers the buckets holding its parameters, its post-hook releases them, and the traced prefetch
(prefetch.py) reads the next modules' buckets on worker threads while the current one computes. What differs
from training is only what is around the hooks: every parameter is in the layout's frozen group (no masters,
no optimizer states, no gradient partitions: the gradient sink refuses to be used), the shards are this
module's own store entries (one per bucket, in the stored dtype), and ``requires_grad`` is off on every
managed parameter while the offload is open (restored by ``close``), so a forward records no backward
whether or not grad mode is on. A generation step runs the same modules in the same order every token, so
after the first forward the trace predicts every gather; when a forward ends, the first modules of the next
one are read ahead (``ParamCoordinator.prefetch_forward``), overlapped with whatever the caller does between
forwards (sampling, the next token's bookkeeping).

[Note: the inference budget]
``budget_bytes`` bounds the bytes of weights materialised at once (in the compute dtype): the buckets of the
module running, those of the next module (read ahead, prefetch on) and, within what is left of the budget,
further modules read ahead ([Note: reading ahead by bytes] in prefetch.py). The layout packs parameters into
buckets of about ``min(1 MiB, budget_bytes // 16)`` and at most ``budget_bytes // 8`` (a parameter larger
gets a bucket of its own, never split), each bucket holding the parameters of one module or of a few
neighbouring ones in model order (never small parameters gathered from all over the model, which every
module would then need), and the
offload refuses a budget smaller than twice the largest module's buckets (once, without prefetch): the
message says what to pass. ``stats().peak_resident_bytes`` is the measured figure: every tensor of weights
read from the store (or converted to the compute dtype) is counted from its creation until it is freed. With
the weights on the host tier in the compute dtype the store lends its own copies (no bytes move, nothing
counted); the store itself then holds the model in memory, which is what the host tier means. The process's resident
memory follows the budget, not the model:
- the memory the weights are read into is recycled ([Note: result memory] in tiers/host.py); while the offload
  is open the pool keeps idle only what the budget leaves beside the result memory lent out (the weights
  held and the reads in flight), so lent and idle together stay within the budget;
- the store gets two page-locked staging buffers: every read goes through them and is copied into that memory
  ([Note: results are read through the pool] in tiers/nvme/reads.py); reading straight into it instead was no
  faster (`tierstore bench inference --params 300e6 --budget 128M --cases accelerate,nvme-fp32`, alternated,
  two runs each: 1.73-1.83x accelerate against 1.86-1.93x through them); its engine gets the fewest bounce
  buffers (io_uring pins them once registered: 32 MiB by default);
- each forward's end returns the heap's free pages (heap.trim: the activations and KV cache freed in it),
  so RSS does not keep the heap's high-water mark token after token;
- the reads ahead run on READ_WORKERS (8) threads, so that every bucket the budget leaves room for, large
  and small, is in flight at once (measured: 4 threads left the disk idler, docs/inference.md). The budget
  itself trades memory for reads in flight: on this machine's disk half of 128 MiB (four of the largest
  Linear of a 1024-wide GPT-2) read a third slower per token.

[Note: filling the weight store]
The store is filled one bucket at a time: each parameter's elements come from its zero.Init handle (whose
chunks are deleted from the Init store as they are taken), from a safetensors checkpoint (one tensor read
at a time through ``safe_open``; parameters may then be on the meta device), or from the parameter's own
value in memory -- whose ``.data`` is emptied afterwards. So a model built under Init or loaded from a
checkpoint is never in memory as a whole: at most one bucket and one checkpoint tensor are (and what is freed
goes back to the system: [Note: freed weights go back to the system] in heap.py).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ...errors import CorruptionError, MisuseError, TierstoreValueError
from ...store import Store
from ...tiers.host import RESULTS
from .. import heap
from ..hooks.coordinator import _READS_CHILDREN, ParamCoordinator
from ..params import registry
from ..params.layout import Layout
from ..params.partitioned import partition, unpartition
from .weight_forms import stored_form, to_compute
from .weight_sources import CheckpointFiles, Sources

TIERS = ("host", "nvme")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, "int8")
DEFAULT_BUDGET = 256 << 20  # bytes
STAGING_BYTES = 8 << 20  # bytes: the store's page-locked buffers (staging_bytes)
READ_WORKERS = 8  # threads reading ahead ([Note: the inference budget])
MIN_IO_BYTES = 1 << 20  # bytes: small parameters are packed into buckets of this much (or budget // 16)


@dataclass(frozen=True)
class InferenceStats:
    """What an offloaded model did, as of one call to ``OffloadedModel.stats()``."""

    stored_bytes: int  # bytes of weights in the store (at rest: int8 codes and scales, bf16, ...)
    weight_bytes: int  # bytes of the weights in the compute dtype
    fetches: int  # bucket reads from the store (read ahead or on demand)
    fetched_bytes: int  # bytes those reads delivered, in the compute dtype
    prefetch_hits: int  # reads done ahead of the module that then used them
    resident_bytes: int  # bytes of weights materialised now ([Note: the inference budget])
    peak_resident_bytes: int  # the most at once since the offload (or reset_peak())
    budget_bytes: int
    forwards: int  # forwards of the model run since the offload
    convert_s: float = 0.0  # seconds the reading threads spent turning stored weights into the compute dtype


class _NoGradients:
    """The gradient sink of offloaded inference: no parameter has a gradient to land in it ([Note: inference
    over the ZeRO-3 hooks]); a backward through the model (for its inputs' gradients) only ends here."""

    def _refuse(self, *_a, **_k):
        raise MisuseError("a model offloaded for inference computes no gradients: its parameters' requires_grad "
                          "is off while the offload is open. Train through Zero3Optimizer instead")

    open = close = keep = abort = open_early = _refuse

    def close_early(self) -> None:  # the end of every backward: nothing was opened
        return None


class OffloadedModel:
    """A model whose weights live in a store while it runs; made by ``offload_for_inference``. ``close()`` (or
    leaving the ``with`` block) removes the hooks and the store; ``close(restore=True)`` first puts every
    parameter's value back in memory (in the compute dtype)."""

    def __init__(self, model: torch.nn.Module, *, tier: str, nvme_path, budget_bytes: int, compute_dtype,
                 weights_dtype, checkpoint, prefetch: bool, device, io_tuning):
        if not isinstance(model, torch.nn.Module):
            raise TierstoreValueError(f"model must be an nn.Module; got {type(model).__name__}")
        if tier not in TIERS:
            raise TierstoreValueError(f"tier={tier!r}: pass 'host' (weights in page-locked memory) or 'nvme' "
                                      f"(weights in files under nvme_path)")
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise TierstoreValueError(f"budget_bytes={budget_bytes!r} must be a positive number of bytes (the "
                                      f"weights materialised at once, e.g. a few layers' worth)")
        if compute_dtype is not None and compute_dtype not in WEIGHT_DTYPES[:3]:
            raise TierstoreValueError(f"compute_dtype={compute_dtype!r}: pass None (the parameters' own dtype), "
                                      f"torch.float32, torch.bfloat16 or torch.float16")
        if weights_dtype is not None and weights_dtype not in WEIGHT_DTYPES:
            raise TierstoreValueError(f"weights_dtype={weights_dtype!r}: pass None (the compute dtype), "
                                      f"torch.float32, torch.bfloat16, torch.float16 or 'int8'")
        registry.check_unowned(model)  # [Note: one optimizer per model] in registry.py
        self.model = model
        self.tier = tier
        self.budget_bytes = budget_bytes
        self._closed = True
        self._lock = threading.Lock()
        self._resident = 0
        self._peak = 0
        self._fetches = 0
        self._fetched = 0
        self._forwards = 0
        self._convert_s = 0.0
        # -- the parameters: canonical names (tied once), every name of each --------------------------
        params: dict[str, torch.nn.Parameter] = {}
        aliases: dict[str, list[str]] = {}
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canon = by_id.setdefault(id(p), name)
            aliases.setdefault(canon, []).append(name)
            params.setdefault(canon, p)
        if not params:
            raise TierstoreValueError("the model has no parameters to offload")
        ckpt = CheckpointFiles(checkpoint) if checkpoint is not None else None
        sources = Sources(params, aliases, ckpt)
        real = [p.device for p in params.values() if not p.is_meta]
        self.device = torch.device(device) if device is not None else (real[0] if real else torch.device("cpu"))
        specs = []
        for name, p in params.items():
            h = getattr(p, "_tierstore_init", None)
            shape, dtype = (tuple(h.shape), h.dtype) if h is not None else (tuple(p.shape), p.dtype)
            if not dtype.is_floating_point:
                raise TierstoreValueError(f"parameter {name!r} has dtype {dtype}: offloaded inference manages "
                                          f"floating-point parameters only")
            specs.append((name, shape, compute_dtype or dtype, False))
        nbytes = {n: torch.Size(s).numel() * dt.itemsize for n, s, dt, _ in specs}
        modules = _module_params(model, params)
        biggest = max(sum(nbytes[n] for n in names) for names in modules)
        bucket = max(-(-biggest // 4096) * 4096, budget_bytes // 8, 4096)  # one module's parameters fit in one
        pack = min(MIN_IO_BYTES, max(4096, budget_bytes // 16))
        self.layout = Layout(specs, [([], {})], 1, min_io_bytes=pack, bucket_bytes=bucket,
                             frozen_groups=_module_runs(modules, nbytes, pack, bucket))
        module_bytes = self._largest_module_bytes(model, params)
        need = module_bytes * (2 if prefetch else 1)
        if budget_bytes < need:
            raise TierstoreValueError(
                f"budget_bytes={budget_bytes} is smaller than {'twice ' if prefetch else ''}the largest module's "
                f"weights ({module_bytes} bytes in the compute dtype"
                f"{'; one module runs while the next is read' if prefetch else ''}): pass budget_bytes >= {need}")
        if weights_dtype == "int8" and tier == "host":
            raise TierstoreValueError("weights_dtype='int8' with tier='host': the host tier keeps tensors decoded, "
                                      "so int8 would round the weights and save no memory; pass "
                                      "weights_dtype=torch.bfloat16, or tier='nvme' (int8 at rest on disk)")
        self.weights_dtype = weights_dtype  # [Note: converting the weights back] in weight_forms.py
        # -- the store ------------------------------------------------------------------------------
        base = os.fspath(nvme_path) if nvme_path is not None else None
        if tier == "nvme" and base is None:
            raise TierstoreValueError("tier='nvme' needs nvme_path= (a directory on the drive to keep the "
                                      "weights on)")
        if base is not None:
            os.makedirs(base, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="tierstore-inference-", dir=base)
        self.store = Store([self._dir], budgets={"host": None if tier == "host" else 0, "device": 0,
                                                 "pinned": staging_bytes(budget_bytes)},
                           io_tuning=io_tuning, _fresh=True, _bounce_bytes=0)
        self._lift_idle = RESULTS.limit_idle(self._idle_room)  # [Note: the inference budget]
        self._closed = False
        self._names: dict[int, list[str]] = {}  # gid -> parameters in its bucket (for error messages)
        try:
            self._fill(sources)
        except BaseException:
            self._teardown()
            raise
        finally:
            sources.done()
        self.stored_bytes = self.store.stats()[tier]["used"]
        # -- the parameters become empty; their values are the store's -------------------------------
        self._requires_grad: dict[str, bool] = {}
        for name, p in list(params.items()):
            h = getattr(p, "_tierstore_init", None)
            dtype = self.layout.specs[name][1]
            if h is not None:
                h.unwrap(p)
                h.discard()
                del p._tierstore_init  # type: ignore[attr-defined]
            if p.is_meta:  # loaded from the checkpoint: a real (empty) parameter in its place, tied ones too
                new = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=self.device), requires_grad=False)
                for alias in aliases[name]:
                    owner, _, leaf = alias.rpartition(".")
                    model.get_submodule(owner)._parameters[leaf] = new
                params[name] = p = new
            self._requires_grad[name] = p.requires_grad
            p.requires_grad_(False)
        self.params = params
        registry.add_offload(self)
        for _n, b in model.named_buffers():
            if compute_dtype is not None and b.is_floating_point() and b.dtype != compute_dtype:
                b.data = b.data.to(compute_dtype)
            if b.device != self.device:  # the buffers go where the model computes
                b.data = b.data.to(self.device)
        lend = self._lend if tier == "host" and weights_dtype in (None, compute_dtype) else None
        self.coordinator = ParamCoordinator(
            model, self.layout, params, self._fetch, _NoGradients(), device=self.device,
            prefetch_depth=1 if prefetch else 0, prefetch_bytes=max(0, budget_bytes - need), lend_shard=lend,
            read_workers=READ_WORKERS)
        for name, p in params.items():  # empty, reading as its full shape ([Note: partitioned parameters read true])
            shape, dtype, _ = self.layout.specs[name]
            partition(p, self.coordinator.empty(dtype), shape)
        # [Note: inference over the ZeRO-3 hooks]: the next forward's first modules are read while the caller
        # works between forwards; registered after the coordinator's own post-hook, so it runs after it
        self._after = model.register_forward_hook(self._forward_done, always_call=True)

    # -- filling ------------------------------------------------------------------------------------------
    def _fill(self, sources: Sources) -> None:
        """[Note: filling the weight store]"""
        for gl in self.layout.groups:
            for bi, b in enumerate(gl.plan.buckets):
                gid = gl.gids[bi]
                buf = torch.zeros(b.numel, dtype=b.dtype)
                for pc, start, stop in b.overlapping(0, b.numel):
                    at = pc.param_offset + start - pc.offset
                    sources.take(pc.name, at, at + stop - start, buf[start:stop])
                self._names[gid] = [pc.name for pc in b.pieces]
                stored = stored_form(buf, self.weights_dtype)
                self.store.put(_key(gid), stored, tier=self.tier)
                nbytes = buf.nbytes + (stored.nbytes if stored.data_ptr() != buf.data_ptr() else 0)
                del buf, stored
                heap.dropped(nbytes)  # [Note: freed weights go back to the system] in heap.py

    def _largest_module_bytes(self, model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> int:
        """Bytes of the buckets the module that needs the most gathers (own and external parameters)."""
        name_of = {id(p): n for n, p in params.items()}
        most = 0
        for m in model.modules():
            own = [p for p in m._parameters.values() if p is not None]
            own += list(m.__dict__.get("_tierstore_external", ()))
            if isinstance(m, _READS_CHILDREN):
                # [Note: modules that read their children's parameters] in hooks/coordinator.py
                own += list(m.parameters())
            gids = {g for p in own if id(p) in name_of for g in self.layout.param_gids[name_of[id(p)]]}
            total = 0
            for g in gids:
                b = self.layout.bucket(g)
                total += b.numel * b.dtype.itemsize
            most = max(most, total)
        return most

    # -- the coordinator's store access ---------------------------------------------------------------------
    def _fetch(self, gid: int) -> torch.Tensor:
        """Bucket `gid`'s values in host memory (a tensor of its own; worker threads call this too): in the
        compute dtype when the CPU computes or the weights are int8, else as stored (the gather converts a bf16 /
        fp16 one on the accelerator). [Note: converting the weights back] in weight_forms.py"""
        try:
            t = self.store.get(_key(gid))
        except CorruptionError as e:
            names = self._names.get(gid, [])
            raise CorruptionError(f"the stored weights of {names[:4]}{' ...' if len(names) > 4 else ''} failed "
                                  f"their checksum ({e.strerror}): the weight files under {self._dir} are damaged; "
                                  f"offload the model again", e.filename, e.offset, e.length) from e
        b = self.layout.bucket(gid)
        if self.weights_dtype == "int8" or (t.dtype != b.dtype and self.device.type == "cpu"):
            # here, on the reading thread; for an accelerator the gather converts a bf16 / fp16 one there
            t0 = time.perf_counter()
            t = to_compute(t, b.dtype, b.numel, self.weights_dtype)
            dt = time.perf_counter() - t0
            with self._lock:
                self._convert_s += dt
        self._count(t)
        return t  # host memory: the prefetch's device stage copies it to an accelerator

    def _lend(self, gid: int):
        """The store's own host copy of bucket `gid`, held until the returned function is called; None when it
        is not usable as it is ([Note: gathering at world size 1] in hooks/coordinator.py)."""
        t = self.store.tensor(_key(gid))
        if "host" not in t.tiers or t.dtype != self.layout.bucket(gid).dtype:
            return None
        cm = t.resident("host")
        x = cm.__enter__()
        if x.device != self.device or not x.is_contiguous():
            cm.__exit__(None, None, None)
            return None
        return x, lambda: cm.__exit__(None, None, None)

    def _count(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        with self._lock:
            self._resident += n
            self._peak = max(self._peak, self._resident)
            self._fetches += 1
            self._fetched += n
        weakref.finalize(t, self._freed, n)

    def _freed(self, n: int) -> None:
        with self._lock:
            self._resident -= n

    def _idle_room(self) -> int:
        """Bytes of result memory the pool may keep idle now (asked under its lock): what the budget leaves
        beside the result memory lent out -- the weights held and the reads in flight ([Note: the inference
        budget])."""
        return self.budget_bytes - RESULTS.lent_bytes

    def _forward_done(self, module, args, output) -> None:
        self._forwards += 1
        heap.trim()  # [Note: the inference budget]
        self.coordinator.prefetch_forward()

    # -- public ---------------------------------------------------------------------------------------------
    def stats(self) -> InferenceStats:
        pf = self.coordinator.prefetcher
        weight = sum(torch.Size(s).numel() * dt.itemsize for s, dt, _ in self.layout.specs.values())
        with self._lock:
            return InferenceStats(stored_bytes=self.stored_bytes, weight_bytes=weight, fetches=self._fetches,
                                  fetched_bytes=self._fetched, prefetch_hits=pf.prefetch_hits,
                                  resident_bytes=self._resident, peak_resident_bytes=self._peak,
                                  budget_bytes=self.budget_bytes, forwards=self._forwards,
                                  convert_s=self._convert_s)

    def reset_peak(self) -> None:
        """Start ``peak_resident_bytes`` again from what is resident now."""
        with self._lock:
            self._peak = self._resident

    def close(self, *, restore: bool = False) -> None:
        """Remove the hooks and the store (its files too). restore=True first gives every parameter its value
        back in memory (in the compute dtype) and its requires_grad, so the model runs as an ordinary one;
        otherwise the parameters stay empty and running the model raises MisuseError."""
        if self._closed:
            return
        restored = False
        try:
            self.coordinator.release_all()
            if restore:
                self._restore()
                restored = True
            for name, p in self.params.items():
                p.requires_grad_(self._requires_grad[name])
        finally:
            self._teardown()
            if not restored:
                self.model.register_forward_pre_hook(_closed_guard)
                registry.mark_released(self.params.values(), repr(self))

    def _restore(self) -> None:
        for name, p in self.params.items():
            shape, dtype, _ = self.layout.specs[name]
            value = torch.empty(shape, dtype=dtype, device=self.device)
            flat = value.view(-1)
            for gid in self.layout.param_gids[name]:
                full = self._fetch(gid)
                for pc in self.layout.bucket(gid).pieces:
                    if pc.name == name:
                        flat[pc.param_offset:pc.param_offset + pc.numel].copy_(full[pc.offset:pc.end])
                del full
            unpartition(p)  # a plain Parameter again ([Note: partitioned parameters read true] in partitioned.py)
            p.data = value

    def __repr__(self) -> str:
        return (f"OffloadedModel({type(self.model).__name__}, tier={self.tier!r}, "
                f"{'closed' if self._closed else 'open'})")

    def managed_param_ids(self) -> set[int]:
        return {id(p) for p in self.params.values()}

    def _teardown(self) -> None:
        self._closed = True
        registry.discard_offload(self)
        coord = getattr(self, "coordinator", None)
        if coord is not None:
            coord.remove()
            self._after.remove()
        self.store.close(flush=False)
        shutil.rmtree(self._dir, ignore_errors=True)
        self._lift_idle()

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._teardown()
        except Exception:  # interpreter shutdown
            pass


def _closed_guard(module: torch.nn.Module, _args) -> None:
    raise MisuseError(f"{type(module).__name__}'s weights were in an offload for inference that was closed: its "
                      f"parameters are empty. Run it inside the offload (`with offload_for_inference(model, ...):`), "
                      f"or close it with close(restore=True) to keep the values in memory")


def _module_params(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> list[list[str]]:
    """The parameters of each module holding some, in model order: each parameter with the first module holding
    it; a module that reads its children's parameters takes theirs (as the hooks gather them)."""
    name_of = {id(p): n for n, p in params.items()}
    seen: set[str] = set()
    out: list[list[str]] = []
    for m in model.modules():
        own = list(m.parameters()) if isinstance(m, _READS_CHILDREN) else \
            [p for p in m._parameters.values() if p is not None]
        names = list(dict.fromkeys(name_of[id(p)] for p in own if id(p) in name_of and name_of[id(p)] not in seen))
        if names:
            out.append(names)
            seen.update(names)
    return out


def _module_runs(modules: list[list[str]], nbytes: dict[str, int], pack: int, cap: int) -> list[list[str]]:
    """`modules` (their parameters, in model order) cut into runs of neighbours: a module of `pack` bytes or
    more, or one that would take the run past `cap`, starts a new run, and a run of `pack` bytes is closed. So
    a bucket serves one module or a few small neighbours, never small parameters gathered from all over the
    model ([Note: the inference budget])."""
    runs: list[list[str]] = []
    run: list[str] = []
    held = 0
    for names in modules:
        size = sum(nbytes[n] for n in names)
        if run and (held >= pack or size >= pack or held + size > cap):
            runs.append(run)
            run, held = [], 0
        run += names
        held += size
    if run:
        runs.append(run)
    return runs


def staging_bytes(budget_bytes: int) -> int:
    """The page-locked staging buffers of the store of an offload (of any budget): two of the store's 4 MiB
    buffers, which the fill's writes and every read go through ([Note: the inference budget])."""
    return STAGING_BYTES


def _key(gid: int) -> str:
    return f"w{gid}"


def offload_for_inference(model: torch.nn.Module, *, tier: str = "nvme", nvme_path: str | os.PathLike | None = None,
                          budget_bytes: int = DEFAULT_BUDGET, compute_dtype: torch.dtype | None = None,
                          weights_dtype: torch.dtype | str | None = None,
                          checkpoint: str | os.PathLike | None = None, prefetch: bool = True,
                          device: torch.device | str | None = None, io_tuning=None) -> OffloadedModel:
    """Move `model`'s weights into a store on `tier` and run it from there: each module's weights are read
    (ahead, with `prefetch`) before it runs and dropped after, so eval loops, ``model.generate`` and
    ``no_grad`` / ``inference_mode`` forwards need ``budget_bytes`` of weights in memory, not the model. Returns
    an ``OffloadedModel`` (a context manager; ``close()`` removes the hooks and the store's files).

    model: built under ``tierstore.zero.Init`` (or ``from_pretrained`` under it: nothing is read into memory),
        an ordinary model (its parameters are emptied as they are stored), or one with parameters on the meta
        device (``accelerate.init_empty_weights()``) together with `checkpoint`.
    tier: 'host' (page-locked memory; the model's bytes in RAM, no disk) or 'nvme' (files under `nvme_path`).
    nvme_path: directory the weight files go to (a fresh subdirectory, removed by close()); with tier='host'
        only the store's lock file goes there (default: the system's temporary directory).
    budget_bytes: bytes of weights materialised at once (the running module, the next, more read ahead); at
        least twice the largest module's weights (the error says how much).
    compute_dtype: dtype the model computes in (None: the parameters' own); floating buffers are cast to it.
    weights_dtype: how the weights are stored: None (the compute dtype), torch.bfloat16 / torch.float16 (half
        the bytes of fp32) or 'int8' (tier='nvme' only: block-wise int8 codes and scales on disk, about a
        quarter; read and dequantized module by module). Outputs equal the in-memory model's bit for bit when
        nothing is rounded (weights stored in the compute dtype).
    checkpoint: a safetensors file or a directory ``save_pretrained`` wrote: the values are read from it, one
        tensor at a time, instead of from the parameters.
    prefetch: read the next modules' weights while the current one computes ([Note: trace] in prefetch.py).
    device: compute device (default: where the parameters are, else the CPU); the buffers are moved there.
    """
    return OffloadedModel(model, tier=tier, nvme_path=nvme_path, budget_bytes=budget_bytes,
                          compute_dtype=compute_dtype, weights_dtype=weights_dtype, checkpoint=checkpoint,
                          prefetch=prefetch, device=device, io_tuning=io_tuning)
