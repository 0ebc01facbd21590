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
tensor; ``param._tierstore_init`` keeps the handle (shape, dtype, the slice held). Peak memory while
building is therefore about the largest module being initialised plus what this rank stores, not the model.
Limits: code that reads ``weight.shape`` of an already-built submodule (e.g. a parent's custom init over
children) sees shape (0,); use ``param._tierstore_init.shape``.

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

import torch

from ..errors import MisuseError
from ..store import Store
from . import _dist
from .config import OffloadConfig

CHUNK_MIN_BYTES = 1 << 20  # a stored chunk of a slice holds max(sub_group_bytes, this) bytes (see _offload)
_active: list[Init] = []
_lock = threading.Lock()


def even_slice(numel: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the flattened elements rank `rank` keeps under Init at world size `world`."""
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


class _Handle:
    """Where an offloaded parameter's value is until the optimizer takes it: elements [lo, hi) of the
    flattened parameter (this rank's even slice; all of them at world size 1), stored in chunks of `chunk`
    elements (keys[i] holds [lo + i * chunk, ...)). See [Note: streaming Init at world size N]."""

    __slots__ = ("init", "keys", "shape", "dtype", "lo", "hi", "chunk", "world", "rank", "_left")

    def __init__(self, init: Init, keys: list[str | None], shape: torch.Size, dtype: torch.dtype, lo: int, hi: int,
                 chunk: int, world: int, rank: int):
        self.init, self.keys, self.shape, self.dtype = init, keys, torch.Size(shape), dtype
        self.lo, self.hi, self.chunk, self.world, self.rank = lo, hi, chunk, world, rank
        self._left = [min(chunk, hi - lo - i * chunk) for i in range(len(keys))]  # elements not yet taken

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
            del vals
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
        self.config = config if config is not None else OffloadConfig()
        self.enabled = enabled
        self.group = process_group
        self.world_size, self.rank = 1, 0
        self.store: Store | None = None
        self._tmpdir: str | None = None
        self._keys = itertools.count()
        self._live = 0
        self._inside = False
        self._patched: dict[type, object] = {}
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
            paths = [os.path.join(p, f"init-rank{self.rank}") for p in cfg.nvme_paths]
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="tierstore-init-")
            paths = [self._tmpdir]
        self.store = Store(paths, device_budget=None if cfg.params == "device" else 0,
                           host_budget=None if cfg.params == "host" else 0, pinned_budget=cfg.pinned_bytes,
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

            def __init_subclass__(cls, **kw):  # classes defined inside the context
                super(torch.nn.Module, cls).__init_subclass__(**kw)
                if init_self._inside:
                    init_self._patch(cls)
            # patching nn.Module for the classes defined inside the context is what Init is for
            torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        with _lock:
            for cls, orig in self._patched.items():
                cls.__init__ = orig  # type: ignore[misc]  # restores the class's own __init__
            self._patched.clear()
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
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_tierstore_init_depth"] = depth
            if depth == 0:
                del module.__dict__["_tierstore_init_depth"]
                if init._inside:
                    init._offload(module)

        __init__.__wrapped__ = orig  # type: ignore[attr-defined]  # for inspect.signature
        self._patched[cls] = orig
        cls.__init__ = __init__  # type: ignore[misc]  # the patch Init exists for; undone in __exit__

    # -- offloading -------------------------------------------------------------------------------------
    def _offload(self, module: torch.nn.Module) -> None:
        any_new = False
        for p in module.parameters():
            if hasattr(p, "_tierstore_init") or p.numel() == 0:
                continue
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
            handle = _Handle(self, keys, p.shape, p.dtype, lo, hi, chunk, self.world_size, self.rank)
            p._tierstore_init = handle  # type: ignore[attr-defined]  # the handle travels with the parameter
            self.offloaded += 1
            self.offloaded_bytes += (hi - lo) * p.element_size()
            self._live += len(keys)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            any_new = True
        if any_new:
            _guard_unclaimed(module)

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
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _guard_unclaimed(module: torch.nn.Module) -> None:
    """A forward pre-hook that refuses to run `module` while a parameter built under Init in it was taken by
    no Zero3Optimizer (its .data is empty and its value is only this rank's slice); removed at the first
    forward where all were taken. See [Note: streaming Init at world size N]."""
    handle = None

    def check(mod, _args):
        left = [n for n, p in mod.named_parameters() if hasattr(p, "_tierstore_init")]
        if left:
            h = next(p for p in mod.parameters() if hasattr(p, "_tierstore_init"))._tierstore_init
            kept = "its whole value" if h.world == 1 else f"only rank {h.rank}'s slice of it (world size {h.world})"
            raise MisuseError(
                f"{type(mod).__name__} was built under tierstore.zero.Init and its parameter(s) {left[:3]} were "
                f"not taken by a Zero3Optimizer (the store holds {kept}; .data is empty). Build the optimizer "
                f"over a model that contains this module before running it, or build the module outside Init")
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
