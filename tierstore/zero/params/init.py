"""zero.Init: partition parameters out of memory as modules are built, so a model larger than memory can be
constructed at all.

    with tierstore.zero.Init(config):
        model = build_model()          # each module's parameters go to the store when its __init__ returns
    opt = Zero3Optimizer(model, torch.optim.AdamW, config=config)   # builds the shards from the store

[Note: when a module is offloaded]
Inside the context every nn.Module subclass's ``__init__`` is wrapped. When the *outermost* ``__init__`` of
an object returns (a subclass calling ``super().__init__()`` does not count, so code after that call may
still initialise the weights), every parameter of the module that is not already offloaded -- its own and
any a parent created -- is written to the store on the ``params`` tier and its ``.data`` becomes an empty
tensor; ``param._tierstore_init`` keeps the handle (shape, dtype, the slice held) and the parameter's class
becomes ``OffloadedParameter`` (see [Note: initialisation right by construction]). Peak memory while
building is therefore about the largest module being initialised plus what this rank stores, not the model
(resident memory too: [Note: freed weights go back to the system] in heap.py).
Parameters on the meta device (a model built under ``torch.device("meta")``, as transformers'
``from_pretrained`` does) are not offloaded there: the real values assigned later are
([Note: from_pretrained under Init]).

[Note: initialisation right by construction]
Emptying each module when its own ``__init__`` returns would leave every later initialisation -- a parent's
``__init__`` re-initialising a child, ``self.apply(self._init_weights)``, transformers' ``post_init()`` --
writing into empty tensors: silently a different model. So an offloaded parameter is an
``OffloadedParameter``, whose ``__torch_function__`` sees every use: questions about its metadata (shape,
size, dim, numel, dtype, device, requires_grad, hashing, hook registration) are answered from the handle
without reading anything -- ``weight.shape`` is the real shape -- and any other use (``normal_``,
``.data``, indexing, ``copy_``, reading it) first *materialises* it: its full value is read back from the
store (at world size N every rank's slice is all-gathered: every rank runs the same construction code, so
the gathers match), it becomes a plain Parameter again and is recorded in the innermost open *scope*, then
the operation runs on the real tensor; views taken of it stay valid while the scope is open. When the scope
closes, every parameter it materialised is written back (this rank's slice) and emptied again. The scopes:
each module's outermost ``__init__`` (so a parent's code after building its children sees and changes their
real values), each call ``fn(module)`` of ``nn.Module.apply`` and of transformers'
``PreTrainedModel._initialize_weights`` (one module at a time: ``post_init`` holds one module's parameters,
not the model), and ``GatheredParameters`` (gathered.py). Memory is therefore bounded by what one scope
touches: a root ``__init__`` that re-initialises parameters directly (not through ``apply``) holds those
until it returns. Outside any scope -- after the model was built, before an optimizer took it -- a use that
needs the value raises MisuseError naming the parameter and the fix (``GatheredParameters``), rather than
computing on an empty tensor. A model built under Init therefore has the same weights, bit for bit, as one
built plainly with the same seed: the same code consumes the same random numbers in the same order, on the
same values.

[Note: from_pretrained under Init]
transformers builds the model of ``from_pretrained`` under ``torch.device("meta")`` (no values; Init leaves
meta parameters alone) and then assigns each loaded tensor with ``setattr(module, name, Parameter(value))``.
While Init is open a global parameter-registration hook offloads every real parameter registered on a
module whose construction has finished, as it is assigned: the checkpoint streams tensor by tensor into the
store (the loader's mmap'ed source tensor is dropped after), and the whole model is never in memory.
Missing keys get their real initialisation through the same scopes as a plain build.

[Note: streaming Init at world size N]
Every rank builds the same model with the same seed, so every rank computes the same values; at world size
N rank r keeps only its *even slice* of each parameter's flattened elements, ``even_slice(numel, N, r)``
(ceil(numel / N) elements per rank, the last ranks shorter or empty), so each rank stores about 1/N of the
model. The partition plan is not known yet (parameter groups come with the optimizer), so the slices are
not the plan's shards: Zero3Optimizer rebuilds those one bucket at a time. Every rank fills a bucket-sized
fp32 buffer with the elements it holds and zero bits elsewhere, and a reduce-scatter **over the buffer's
bits as int32 with SUM** hands each rank its plan shard: every element is held by exactly one rank, and
x + 0 + ... + 0 is x exactly for integers, so each element arrives bit for bit -- -0.0, inf, NaN and its
payload included (a float SUM would have turned -0.0 into +0.0). The fp32 buffer is what the plain build
produces too (masters are ``value.to(float32)``; exact from fp16/bf16/fp32), so a model built under Init
and a plain build with the same seed give identical shards. The optimizer's memory for this is one bucket
(plus one stored chunk), and each chunk of a slice is deleted as soon as all its elements were taken. At
world size 1 the "slice" is the whole parameter and no collective runs. The slices only mean something to
the group that stored them: the optimizer refuses a parameter built under Init with another world size or
rank (the message says to pass the same process group to both).
A parameter built under Init that no Zero3Optimizer takes keeps only this rank's slice and an empty
``.data``: a forward pre-hook on the module that offloaded it raises a MisuseError naming it (instead of a
shape error deep in the forward); the hook removes itself at the first forward where every parameter was
taken.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ...errors import MisuseError
from ...store import Store
from .. import _dist, heap, scratch
from ..config import OffloadConfig
from .partitioned import func_name

CHUNK_MIN_BYTES = 1 << 20  # a stored chunk of a slice holds max(sub_group_bytes, this) bytes (see _offload)
_active: list[Init] = []
_lock = threading.Lock()
_scopes: list[_Scope] = []  # open scopes, innermost last ([Note: initialisation right by construction])


def even_slice(numel: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the flattened elements rank `rank` keeps under Init at world size `world`."""
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


class _Handle:
    """Where an offloaded parameter's value is until the optimizer takes it: elements [lo, hi) of the
    flattened parameter (this rank's even slice; all of them at world size 1), stored in chunks of `chunk`
    elements (keys[i] holds [lo + i * chunk, ...)). See [Note: streaming Init at world size N]."""

    __slots__ = ("init", "keys", "shape", "dtype", "lo", "hi", "chunk", "world", "rank", "_left", "cls")

    def __init__(self, init: Init, keys: list[str | None], shape: torch.Size, dtype: torch.dtype, lo: int, hi: int,
                 chunk: int, world: int, rank: int, cls: type = torch.nn.Parameter):
        self.init, self.keys, self.shape, self.dtype = init, keys, torch.Size(shape), dtype
        self.lo, self.hi, self.chunk, self.world, self.rank = lo, hi, chunk, world, rank
        self._left = [min(chunk, hi - lo - i * chunk) for i in range(len(keys))]  # elements not yet taken
        self.cls = cls  # the parameter's own class, given back by unwrap()

    @property
    def numel(self) -> int:  # elements of the whole parameter
        return self.shape.numel()

    def unwrap(self, p: torch.Tensor) -> None:
        """Give `p` back its own class (a plain Parameter; .data stays empty): the optimizer takes it from here."""
        if isinstance(p, OffloadedParameter):
            p.__class__ = self.cls

    def read(self, a: int, b: int, out: torch.Tensor) -> None:
        """Like take(), without taking: the chunks stay."""
        a2, b2 = max(a, self.lo), min(b, self.hi)
        if a2 >= b2:
            return
        for i in range((a2 - self.lo) // self.chunk, (b2 - 1 - self.lo) // self.chunk + 1):
            c_lo = self.lo + i * self.chunk
            s, e = max(a2, c_lo), min(b2, c_lo + self.chunk)
            key = self.keys[i]
            if key is None:
                raise MisuseError("a parameter built under zero.Init was already taken by a Zero3Optimizer; use "
                                  "GatheredParameters / opt.gathered() to read it")
            vals = self.init.live_store().get(key)
            out[s - a:e - a].copy_(vals[s - c_lo:e - c_lo])
            heap.dropped(vals.nbytes)  # [Note: freed weights go back to the system] in heap.py
            del vals

    def read_full(self, group) -> torch.Tensor:
        """The parameter's whole value (its shape and dtype): this rank's slice, all-gathered at world size N
        (a collective: every rank reads the same parameter in the same order)."""
        n = self.numel
        if self.world == 1:
            out = torch.empty(n, dtype=self.dtype)
            self.read(0, n, out)
            return out.view(self.shape)
        per = -(-n // self.world)  # elements per rank (even_slice)
        mine = torch.zeros(per, dtype=self.dtype)
        self.read(self.lo, self.hi, mine[:self.hi - self.lo])
        full = torch.empty(per * self.world, dtype=self.dtype)
        _dist.all_gather(mine, full, group)
        return full[:n].view(self.shape).clone()

    def write_full(self, value: torch.Tensor) -> None:
        """Replace the stored slice with this rank's elements of `value` (the whole parameter)."""
        flat = value.detach().reshape(-1)
        for i, key in enumerate(self.keys):
            if key is None:
                raise MisuseError("a parameter built under zero.Init was already taken by a Zero3Optimizer; write "
                                  "it through GatheredParameters(..., modifier_rank=...) or opt.gathered()")
            c_lo = self.lo + i * self.chunk
            self.init.live_store().put(key, flat[c_lo:min(c_lo + self.chunk, self.hi)], tier=self.init.config.params)

    @property
    def sliced(self) -> bool:
        """True when other ranks hold the rest of the value (world size > 1)."""
        return self.world > 1

    def take(self, a: int, b: int, out: torch.Tensor) -> None:
        """Copy the held elements of flattened range [a, b) into out[(element - a)] (out: 1-D, b - a elements,
        any dtype: converted like Tensor.copy_); elements not held are left as they are. A chunk whose every
        element has been taken is deleted from the store. Each element may be taken once."""
        a2, b2 = max(a, self.lo), min(b, self.hi)
        if a2 >= b2:
            return
        first, last = (a2 - self.lo) // self.chunk, (b2 - 1 - self.lo) // self.chunk
        for i in range(first, last + 1):
            c_lo = self.lo + i * self.chunk
            s, e = max(a2, c_lo), min(b2, c_lo + self.chunk)
            key = self.keys[i]
            if key is None:
                raise MisuseError(f"elements [{s}, {e}) of a parameter built under zero.Init were already "
                                  f"taken by an optimizer; a parameter can be partitioned by one Zero3Optimizer")
            vals = self.init.live_store().get(key)
            out[s - a:e - a].copy_(vals[s - c_lo:e - c_lo])
            nbytes = vals.nbytes
            del vals
            heap.dropped(nbytes)  # [Note: freed weights go back to the system] in heap.py
            self._left[i] -= e - s
            if self._left[i] <= 0:
                self.init._discard(key)
                self.keys[i] = None

    def discard(self) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.init._discard(k)
                self.keys[i] = None

    def __del__(self) -> None:
        # the parameter holding this handle is gone without an optimizer taking it (e.g. replaced by tying,
        # `head.weight = embed.weight`): free its chunks now rather than when the process ends
        try:
            self.discard()
        except Exception:  # interpreter shutdown, or the Init store already closed: nothing left to free
            pass


class Init:
    """Context manager; see the module docstring. config: the OffloadConfig the optimizer will use (its
    ``params`` tier holds the values meanwhile, in chunks of ``sub_group_bytes``, at least 1 MiB).
    enabled=False makes it a no-op (e.g. for small runs). process_group: the data-parallel group the
    optimizer will use (default: the whole world when torch.distributed is initialised); at world size N each
    rank keeps 1/N of every parameter ([Note: streaming Init at world size N])."""

    def __init__(self, config: OffloadConfig | None = None, *, enabled: bool = True, process_group=None):
        self.config = OffloadConfig.coerce(config)
        self.enabled = enabled
        self.group = process_group
        self.world_size, self.rank = 1, 0
        self.store: Store | None = None
        self._dirs: list[str] = []  # the store's directories: scratch space of this context, removed with the store
        self._keys = itertools.count()
        self._live = 0
        self._inside = False
        self._patched: dict[type, object] = {}
        self._method_patches: list[tuple[type, str, object]] = []  # (owner, attribute, original)
        self._hf_patched = False  # PreTrainedModel._initialize_weights is patched
        self._registration: Any = None  # the parameter-registration hook's handle while the context is open
        self._orig_init_subclass = None
        self.offloaded = 0  # parameters written to the store
        self.offloaded_bytes = 0  # bytes this rank stored (about 1/N of the parameters at world size N)

    @property
    def stored_chunks(self) -> int:
        """Chunks of parameter values still in the Init store: written when a module was built, not yet taken
        by an optimizer (nor freed with a parameter that was replaced). 0 once everything was taken."""
        return self._live

    # -- the context ------------------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        cfg = self.config
        self.world_size, self.rank = _dist.world_and_rank(self.group)
        if cfg.nvme_paths:
            # [Note: scratch directories are marked] in scratch.py: removed by _close, so only its own
            paths = [scratch.claim(os.path.join(p, f"init-rank{self.rank}"), "zero.Init") for p in cfg.nvme_paths]
        else:
            paths = [tempfile.mkdtemp(prefix="tierstore-init-")]
        self._dirs = paths
        self.store = Store(paths, budgets={"device": None if cfg.params == "device" else 0,
                                           "host": None if cfg.params == "host" else 0, "pinned": cfg.pinned_bytes},
                           io_tuning=cfg.io_tuning,
                           _fresh=True)  # starts empty; discards a previous run's manifest under its locks
        self._inside = True
        with _lock:
            _active.append(self)
            for cls in _all_subclasses(torch.nn.Module):
                self._patch(cls)
            init_self = self
            orig = torch.nn.Module.__dict__.get("__init_subclass__")
            self._orig_init_subclass = orig

            def __init_subclass__(cls: type[torch.nn.Module], **kw):  # classes defined inside the context
                super(torch.nn.Module, cls).__init_subclass__(**kw)
                if init_self._inside:
                    init_self._patch(cls)
            # patching nn.Module for the classes defined inside the context is what Init is for
            torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[method-assign,assignment]
            self._scoped_patches()
            # [Note: from_pretrained under Init]: real parameters assigned to built modules are offloaded
            self._registration = torch.nn.modules.module.register_module_parameter_registration_hook(
                self._on_register)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        with _lock:
            for cls, orig in self._patched.items():
                cls.__init__ = orig  # type: ignore[misc]  # restores the class's own __init__
            self._patched.clear()
            for owner, attr, fn in self._method_patches:
                setattr(owner, attr, fn)
            self._method_patches.clear()
            self._hf_patched = False
            self._registration.remove()
            if self._orig_init_subclass is None:
                del torch.nn.Module.__init_subclass__
            else:
                torch.nn.Module.__init_subclass__ = self._orig_init_subclass
            _active.remove(self)
        self._inside = False
        if self._live == 0:
            self._close()

    def _patch(self, cls: type) -> None:
        if cls in self._patched or "__init__" not in cls.__dict__:
            return
        orig = cls.__dict__["__init__"]
        init = self

        def __init__(module, *args, **kwargs):
            depth = module.__dict__.get("_tierstore_init_depth", 0)
            module.__dict__["_tierstore_init_depth"] = depth + 1
            scope = _Scope(keep=True) if depth == 0 else None  # [Note: initialisation right by construction]
            if scope is not None:
                if not init._hf_patched:
                    init._patch_transformers()
                _scopes.append(scope)
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_tierstore_init_depth"] = depth
                if scope is not None:
                    scope.close()
            if depth == 0:
                del module.__dict__["_tierstore_init_depth"]
                if init._inside:
                    init._offload(module)

        __init__.__wrapped__ = orig  # type: ignore[attr-defined]  # for inspect.signature
        self._patched[cls] = orig
        cls.__init__ = __init__  # type: ignore[misc]  # the patch Init exists for; undone in __exit__

    def _scoped_patches(self) -> None:
        """nn.Module.apply and transformers' PreTrainedModel._initialize_weights: one scope per module they
        initialise ([Note: initialisation right by construction]). Undone in __exit__."""

        def apply(module, fn):
            for child in module.children():
                child.apply(fn)
            with _Scope(keep=True):
                fn(module)
            return module
        apply.__doc__ = torch.nn.Module.apply.__doc__
        self._method_patches.append((torch.nn.Module, "apply", torch.nn.Module.__dict__["apply"]))
        torch.nn.Module.apply = apply  # type: ignore[method-assign]
        self._patch_transformers()

    def _patch_transformers(self) -> None:
        """transformers' PreTrainedModel._initialize_weights, once transformers.modeling_utils is imported (it
        may be imported lazily, by the first model class used inside the context)."""
        import sys
        mu = sys.modules.get("transformers.modeling_utils")
        base = getattr(mu, "PreTrainedModel", None)
        if base is None or self._hf_patched or "_initialize_weights" not in base.__dict__:
            return
        orig = base.__dict__["_initialize_weights"]

        def _initialize_weights(model, module, *args, **kwargs):
            with _Scope(keep=True):
                return orig(model, module, *args, **kwargs)
        self._method_patches.append((base, "_initialize_weights", orig))
        base._initialize_weights = _initialize_weights
        self._hf_patched = True

    def _on_register(self, module: torch.nn.Module, name: str, param):
        """Global parameter-registration hook: a real parameter assigned to a module already built is
        offloaded now ([Note: from_pretrained under Init])."""
        if (self._inside and param is not None and "_tierstore_init_depth" not in module.__dict__
                and not hasattr(param, "_tierstore_init") and not param.is_meta and param.numel() > 0):
            self._offload_param(param)
            _guard_unclaimed(module)
            _state_dict_scopes(module)
        return None

    # -- offloading -------------------------------------------------------------------------------------
    def _offload(self, module: torch.nn.Module) -> None:
        any_new = False
        for p in module.parameters():
            if hasattr(p, "_tierstore_init") or p.is_meta or p.numel() == 0:
                continue
            self._offload_param(p)
            any_new = True
        if any_new:
            _guard_unclaimed(module)
            _state_dict_scopes(module)

    def _offload_param(self, p: torch.nn.Parameter) -> None:
        """Write p's value (this rank's slice) to the store, empty p and make it an OffloadedParameter."""
        n = p.numel()
        lo, hi = even_slice(n, self.world_size, self.rank)
        # chunks of about a sub-group: the optimizer holds one while it fills a bucket; the floor keeps
        # test-sized sub-groups (KiB) from cutting a parameter into thousands of store entries
        chunk = max(1, max(self.config.sub_group_bytes, CHUNK_MIN_BYTES) // p.element_size())  # elements
        flat = p.data.detach().reshape(-1)
        keys: list[str | None] = []  # None once the optimizer took the chunk
        with torch.profiler.record_function("tierstore::init_offload"):
            for at in range(lo, hi, chunk):
                key = f"i{next(self._keys)}"
                self.live_store().put(key, flat[at:min(at + chunk, hi)], tier=self.config.params)
                keys.append(key)
        del flat
        handle = _Handle(self, keys, p.shape, p.dtype, lo, hi, chunk, self.world_size, self.rank, type(p))
        self.offloaded += 1
        self.offloaded_bytes += (hi - lo) * p.element_size()
        self._live += len(keys)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        _wrap(p, handle)
        heap.dropped(n * p.element_size())  # [Note: freed weights go back to the system] in heap.py

    def live_store(self) -> Store:
        """The store of the chunks (while the context is open, and until every chunk was taken)."""
        if self.store is None:
            raise MisuseError("zero.Init has no store: enter the context (`with zero.Init(...):`) before building "
                              "the model")
        return self.store

    def _discard(self, key: str) -> None:
        if self.store is not None and key in self.store:
            self.store.delete(key)
            self._live -= 1
        if self._live == 0 and not self._inside:
            self._close()

    def _close(self) -> None:
        if self.store is not None:
            self.store.close(flush=False)
            self.store = None
        # The chunks were all taken: the store's files are scratch (it started `_fresh`, nothing reopens it), and
        # left behind they would hold disk space the size of the model's parameters for the rest of the run.
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs = []


class OffloadedParameter(torch.nn.Parameter):
    """A parameter zero.Init wrote to its store (``.data`` is empty; ``_tierstore_init`` is the handle). Its
    metadata reads as the real parameter's; any use that needs the value brings it back inside the innermost
    open scope, or raises outside one. See [Note: initialisation right by construction]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        h = getattr(first, "_tierstore_init", None) if isinstance(first, OffloadedParameter) else None
        if h is not None:
            meta = _META.get(func)
            if meta is not None:
                return meta(h, args, kwargs)
            if func in _PASS:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if func is torch.Tensor.__repr__:
                return (f"OffloadedParameter(shape={tuple(h.shape)}, dtype={h.dtype}; value offloaded by "
                        f"tierstore.zero.Init)")
        for t in tree_leaves((args, kwargs)):  # checked as it goes: a tensor passed twice is materialised once
            if isinstance(t, OffloadedParameter) and hasattr(t, "_tierstore_init"):
                _materialize(t, func)
        return func(*args, **kwargs)


def _size(h: _Handle, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return h.shape if dim is None else h.shape[dim]


_T = torch.Tensor
_META = {_T.shape.__get__: lambda h, a, k: h.shape, _T.size: _size,  # type: ignore[attr-defined]
         _T.dim: lambda h, a, k: len(h.shape), _T.ndimension: lambda h, a, k: len(h.shape),
         _T.ndim.__get__: lambda h, a, k: len(h.shape),  # type: ignore[attr-defined]
         _T.numel: lambda h, a, k: h.numel, _T.nelement: lambda h, a, k: h.numel,
         _T.dtype.__get__: lambda h, a, k: h.dtype,  # type: ignore[attr-defined]
         _T.__len__: lambda h, a, k: h.shape[0]}
_PASS = {getattr(_T, n).__get__ if isinstance(getattr(_T, n, None), type(_T.device)) else getattr(_T, n)
         for n in ("device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_meta", "is_cuda",
                   "is_sparse", "is_quantized", "is_floating_point", "is_complex", "element_size", "get_device",
                   "__hash__", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_")
         if hasattr(_T, n)}
_PASS.update({_T.requires_grad.__set__, _T.grad.__set__, _T.is_contiguous})  # type: ignore[attr-defined,union-attr]


def _wrap(p: torch.Tensor, handle: _Handle) -> None:
    p._tierstore_init = handle  # type: ignore[attr-defined]  # the handle travels with the parameter
    try:
        p.__class__ = OffloadedParameter
    except TypeError:  # a parameter subclass with its own layout keeps its class (and an empty .data)
        pass


def _materialize(p: torch.Tensor, func) -> None:
    """Bring back p's value into the innermost open scope ([Note: initialisation right by construction])."""
    h: _Handle = p._tierstore_init  # type: ignore[attr-defined]
    if not _scopes:
        what = func_name(func)
        raise MisuseError(
            f"{what} on a parameter of shape {tuple(h.shape)} that tierstore.zero.Init offloaded: its value is in "
            f"the store (.data is empty) and no scope is open to bring it back. Read or change it inside "
            f"`with tierstore.zero.GatheredParameters([param], modifier_rank=0):` (the writes are kept), or build "
            f"the Zero3Optimizer first and use the model through it")
    scope = _scopes[-1]
    with torch._C.DisableTorchFunctionSubclass():
        device = p.device
    full = h.read_full(h.init.group)
    del p._tierstore_init  # type: ignore[attr-defined]
    h.unwrap(p)
    p.data = full.to(device)
    scope.touched.append((p, h))


class _Scope:
    """Parameters materialised while it is open are written back (keep=True; at world size N from rank `src`
    when given) and emptied again when it closes. See [Note: initialisation right by construction]."""

    def __init__(self, keep: bool = True, src: int | None = None):
        self.keep, self.src = keep, src
        self.touched: list[tuple[torch.Tensor, _Handle]] = []

    def __enter__(self) -> _Scope:
        _scopes.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self in _scopes:
            _scopes.remove(self)
        touched, self.touched = self.touched, []
        for p, h in touched:
            if hasattr(p, "_tierstore_init"):
                continue
            v = p.data
            if self.keep and h.world > 1 and self.src is not None:
                import torch.distributed as dist
                v = v.contiguous()
                group = h.init.group
                dist.broadcast(v, src=dist.get_global_rank(group, self.src) if group is not None else self.src,
                               group=group)
            if self.keep and (v.shape != h.shape or v.dtype != h.dtype):  # replaced by another shape: anew
                h.discard()
                p.data = v
                h.init._offload_param(p)  # type: ignore[arg-type]
                continue
            if self.keep:
                h.write_full(v)
            p.data = torch.empty(0, dtype=h.dtype, device=v.device)
            _wrap(p, h)
            del v
            heap.dropped(h.numel * h.dtype.itemsize)  # [Note: freed weights go back to the system] in heap.py


def _state_dict_scopes(module: torch.nn.Module) -> None:
    """state_dict() and load_state_dict() of a module holding offloaded parameters (built under Init, not yet
    taken by an optimizer) run inside scopes ([Note: initialisation right by construction]): state_dict in
    one scope that drops nothing it returns (the full values it hands out stay alive in the dict; nothing is
    written back), load_state_dict in one scope per module, written back when the module's subtree is loaded
    -- so at most one module's parameters (plus its ancestors') are held. Collective at world size N, like
    every materialisation. Installed once per module."""
    if module.__dict__.get("_tierstore_state_scopes"):
        return
    module.__dict__["_tierstore_state_scopes"] = True
    saving: dict[int, _Scope] = {}

    def save_pre(mod, prefix, keep_vars):
        if not prefix:  # a new call (nested ones have a prefix): a scope an interrupted call left is dropped
            while _saving_scopes:
                _saving_scopes.pop().close()
        if not _saving_scopes:  # the outermost state_dict call holding offloaded parameters
            scope = _Scope(keep=False)
            _scopes.append(scope)
            _saving_scopes.append(scope)
            saving[id(mod)] = scope

    def save_post(mod, destination, prefix, local_metadata):
        scope = saving.pop(id(mod), None)
        if scope is not None:
            _saving_scopes.remove(scope)
            scope.close()

    def load_pre(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        _scopes.append(_Scope(keep=True))
        loading.append((mod, _scopes[-1]))

    def load_post(mod, incompatible):
        for i in range(len(loading) - 1, -1, -1):
            if loading[i][0] is mod:
                loading.pop(i)[1].close()
                break

    loading: list = []
    module.register_state_dict_pre_hook(save_pre)
    module.register_state_dict_post_hook(save_post)
    module.register_load_state_dict_pre_hook(load_pre)
    module.register_load_state_dict_post_hook(load_post)


_saving_scopes: list[_Scope] = []


def _guard_unclaimed(module: torch.nn.Module) -> None:
    """A forward pre-hook that refuses to run `module` while a parameter built under Init in it was taken by
    no Zero3Optimizer (its .data is empty and its value is only this rank's slice); removed at the first
    forward where all were taken. See [Note: streaming Init at world size N]."""

    def check(mod, _args):
        left = [n for n, p in mod.named_parameters() if hasattr(p, "_tierstore_init")]
        if left:
            h = next(p for p in mod.parameters() if hasattr(p, "_tierstore_init"))._tierstore_init
            kept = "its whole value" if h.world == 1 else f"only rank {h.rank}'s slice of it (world size {h.world})"
            raise MisuseError(
                f"{type(mod).__name__} was built under tierstore.zero.Init and its parameter(s) {left[:3]} were "
                f"not taken by a Zero3Optimizer (the store holds {kept}; .data is empty). Build the optimizer "
                f"over a model that contains this module before running it, run the model for inference through "
                f"tierstore.zero.offload_for_inference(model, ...), or build the module outside Init")
        handle.remove()

    handle = module.register_forward_pre_hook(check)


def reduce_scatter_exact(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's shard of the element-wise sum over ranks of `full` (fp32, numel divisible by the world
    size), summed as int32 bits: exact when at most one rank has a nonzero word per element (then the sum *is*
    that rank's word, whatever float it encodes). See [Note: streaming Init at world size N]."""
    import torch.distributed as dist
    world, _ = _dist.world_and_rank(group)
    if world == 1:
        return full
    out = torch.empty(full.numel() // world, dtype=full.dtype, device=full.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out.view(torch.int32), full.contiguous().view(torch.int32), op=dist.ReduceOp.SUM, group=group)
    return out


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    todo: list[type] = [cls]
    while todo:
        subclasses: list[type] = todo.pop().__subclasses__()
        for s in subclasses:
            if s not in out:
                out.append(s)
                todo.append(s)
    return out
