"""The types of what callers hand to tierstore: codecs and tensor-like values.

``Codec`` is the Store's ``codec=`` argument (``Store.put``) and a TieredTensor's codec: any numcodecs-style
object ([Note: codecs] in encoding.py) — numcodecs' own codecs, tierstore.quant's block quantizers, the identity
codec. ``TensorLike`` is what ``Store.put`` and ``TieredTensor.update`` accept as a value: a torch tensor on
any device, a numpy array, or any DLPack producer (cupy, jax, ...). Both are checked at run time
(``isinstance(x, Codec)``; ``SupportsDLPack`` for the last kind of value), so they are runtime_checkable:
that checks that the methods exist, not their signatures (mypy does that).

The I/O backend protocol lives with the engine that consumes it (``tierstore.io.Backend``).
"""
from __future__ import annotations

from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch

__all__ = ["Codec", "SupportsDLPack", "TensorLike"]


@runtime_checkable
class Codec(Protocol):
    """How a tensor is encoded at rest: the numcodecs ``Codec`` interface.

    ``encode`` takes a contiguous ndarray and returns a bytes-like object; ``decode`` returns an ndarray-like
    of the original bytes (into ``out`` when given); ``get_config`` returns a JSON-serialisable dict with an
    ``"id"`` that ``numcodecs.get_codec`` rebuilds the codec from (it is stored in the Store's manifest)."""

    def encode(self, buf: Any) -> Any: ...

    def decode(self, buf: Any, out: Any = None) -> Any: ...

    def get_config(self) -> dict[str, Any]: ...


@runtime_checkable
class SupportsDLPack(Protocol):
    """A DLPack producer (the array API's ``__dlpack__`` / ``__dlpack_device__``), read with torch.from_dlpack."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[Any, int]: ...


#: a value Store.put / TieredTensor.update accept (copied; torch tensors of any device)
TensorLike: TypeAlias = torch.Tensor | np.ndarray | SupportsDLPack
