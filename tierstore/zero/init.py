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
tensor; ``param._tierstore_init`` keeps the handle (shape, dtype, key). Peak memory while building is
therefore about the largest module being initialised plus the store's staging, not the model. The
optimizer reads each parameter once from the store when it cuts the shards, then deletes it.
Limits: code that reads ``weight.shape`` of an already-built submodule (e.g. a parent's custom init over
children) sees shape (0,); use ``param._tierstore_init.shape``. At world size N every rank builds (and
stores) the whole model before cutting its shard: the same memory bound, N times the disk.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading

import torch

from ..store import Store
from . import _dist
from .config import OffloadConfig

_active: list["Init"] = []
_lock = threading.Lock()


class _Handle:
    """Where an offloaded parameter's value is until the optimizer takes it."""

    __slots__ = ("init", "key", "shape", "dtype")

    def __init__(self, init: "Init", key: str, shape: torch.Size, dtype: torch.dtype):
        self.init, self.key, self.shape, self.dtype = init, key, torch.Size(shape), dtype

    def load(self) -> torch.Tensor:
        return self.init.store.get(self.key).view(self.shape)

    def discard(self) -> None:
        self.init._discard(self.key)


class Init:
    """Context manager; see the module docstring. config: the OffloadConfig the optimizer will use (its
    ``params`` tier holds the values meanwhile). enabled=False makes it a no-op (e.g. for small runs)."""

    def __init__(self, config: OffloadConfig | None = None, *, enabled: bool = True):
        self.config = config if config is not None else OffloadConfig()
        self.enabled = enabled
        self.store: Store | None = None
        self._tmpdir = None
        self._keys = itertools.count()
        self._live = 0
        self._inside = False
        self._patched: dict[type, object] = {}
        self._orig_init_subclass = None
        self.offloaded = 0  # parameters written to the store
        self.offloaded_bytes = 0  # bytes

    # -- the context ------------------------------------------------------------------------------------
    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        cfg = self.config
        _world, rank = _dist.world_and_rank()
        if cfg.nvme_paths:
            paths = [os.path.join(p, f"init-rank{rank}") for p in cfg.nvme_paths]
            for p in paths:
                if os.path.exists(os.path.join(p, "manifest.json")):
                    os.unlink(os.path.join(p, "manifest.json"))
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="tierstore-init-")
            paths = [self._tmpdir]
        self.store = Store(paths, device_budget=None if cfg.params == "device" else 0,
                           host_budget=None if cfg.params == "host" else 0, pinned_budget=cfg.pinned_bytes)
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
            torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        with _lock:
            for cls, orig in self._patched.items():
                cls.__init__ = orig
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

        __init__.__wrapped__ = orig
        self._patched[cls] = orig
        cls.__init__ = __init__

    # -- offloading -------------------------------------------------------------------------------------
    def _offload(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if hasattr(p, "_tierstore_init") or p.numel() == 0:
                continue
            key = f"i{next(self._keys)}"
            with torch.profiler.record_function("tierstore::init_offload"):
                self.store.put(key, p.data.detach(), tier=self.config.params)
            p._tierstore_init = _Handle(self, key, p.shape, p.dtype)
            self.offloaded += 1
            self.offloaded_bytes += p.numel() * p.element_size()
            self._live += 1
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

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


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in out:
                out.append(s)
                todo.append(s)
    return out
