"""Where offloaded inference takes each parameter's values from while it fills the store: a zero.Init handle,
the parameter's own (in-memory) value, or a safetensors checkpoint. One parameter's value at most is held at a
time. See [Note: filling the weight store] in inference/offload.py.
"""
from __future__ import annotations

import json
import os

import torch

from ...errors import TierstoreValueError
from .. import heap


class CheckpointFiles:
    """The tensors of a safetensors checkpoint: one ``.safetensors`` file, or a directory holding
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Tensors are read one at a time
    (``safe_open``: the file is mapped, only the named tensor's bytes are copied out)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.path = path
        self._where: dict[str, str] = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map", {})
                self._where = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.exists(single):
                path = single
            else:
                raise TierstoreValueError(f"checkpoint={self.path!r} is a directory without model.safetensors or "
                                          f"model.safetensors.index.json: pass a .safetensors file or such a "
                                          f"directory (what save_pretrained writes)")
        if not self._where:
            if not os.path.isfile(path):
                raise TierstoreValueError(f"checkpoint={self.path!r} does not exist: pass a .safetensors file or "
                                          f"a directory save_pretrained wrote")
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                self._where = {k: path for k in f.keys()}
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def find(self, names: list[str]) -> str | None:
        """The first of `names` (a parameter's names, tied aliases included) the checkpoint holds."""
        return next((n for n in names if n in self._where), None)

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        file = self._where[name]
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = safe_open(file, framework="pt").__enter__()
        return f.get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)  # type: ignore[attr-defined]
        self._open.clear()


class Sources:
    """Values of a model's parameters, flattened ranges at a time: ``take(name, a, b, out)``. Keeps the last
    parameter read from a checkpoint (a parameter cut over several buckets is read once)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], aliases: dict[str, list[str]],
                 checkpoint: CheckpointFiles | None):
        self.params = params
        self.aliases = aliases  # canonical name -> every name of the parameter (tied ones share it)
        self.ckpt = checkpoint
        self._last: tuple[str, torch.Tensor] | None = None
        if checkpoint is None:
            meta = [n for n, p in params.items() if p.is_meta and not hasattr(p, "_tierstore_init")]
            if meta:
                raise TierstoreValueError(f"parameters {meta[:3]} are on the meta device (no values): pass "
                                          f"checkpoint= (a safetensors file or directory) to load them from")
        else:
            missing = [n for n in params if checkpoint.find(aliases[n]) is None]
            if missing:
                raise TierstoreValueError(f"checkpoint={checkpoint.path!r} holds no tensor for parameters "
                                          f"{missing[:3]} ({len(missing)} missing): pass the checkpoint of this "
                                          f"model (its names are those of model.named_parameters())")

    def take(self, name: str, a: int, b: int, out: torch.Tensor) -> None:
        """out (b - a elements, any dtype: converted like Tensor.copy_) <- flattened elements [a, b) of `name`."""
        p = self.params[name]
        if self.ckpt is not None:
            value = self._checkpoint_value(name, p)
            out.copy_(value.reshape(-1)[a:b])
            return
        handle = getattr(p, "_tierstore_init", None)
        if handle is not None:
            if handle.sliced:
                raise TierstoreValueError(f"parameter {name!r} was built under zero.Init at world size "
                                          f"{handle.world}: offloaded inference runs on one process; build the "
                                          f"model under Init without a process group")
            handle.take(a, b, out)  # chunks taken are deleted from the Init store
            return
        out.copy_(p.detach().reshape(-1)[a:b])

    def _checkpoint_value(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        assert self.ckpt is not None
        key = self.ckpt.find(self.aliases[name])
        assert key is not None
        self._drop_last()  # the previous parameter's value goes before the next one is read
        value = self.ckpt.read(key)
        shape = tuple(p._tierstore_init.shape) if hasattr(p, "_tierstore_init") else tuple(p.shape)
        if tuple(value.shape) != shape:
            raise TierstoreValueError(f"checkpoint {self.ckpt.path!r}: tensor {key!r} has shape "
                                      f"{tuple(value.shape)}, parameter {name!r} has {shape}: pass the checkpoint "
                                      f"of this model's configuration")
        self._last = (name, value)
        return value

    def _drop_last(self) -> None:
        if self._last is not None:
            nbytes = self._last[1].nbytes
            self._last = None
            heap.dropped(nbytes)  # [Note: freed weights go back to the system] in heap.py

    def done(self) -> None:
        self._drop_last()
        if self.ckpt is not None:
            self.ckpt.close()
