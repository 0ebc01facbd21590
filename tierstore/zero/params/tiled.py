"""TiledLinear: nn.Linear cut into tiles that ZeRO-3 gathers and releases one at a time.

[Note: memory-centric tiling]
ZeRO-Infinity (Rajbhandari et al., SC'21, sec. 5.1.3 "memory-centric tiling") runs a layer too large for
working memory as a sequence of smaller ones: y = x W^T + b with W cut into out_splits x in_splits tiles is
y[:, rows_j] = sum_i x[:, cols_i] W_ji^T (+ b_j on the first column tile). Each tile is its own nn.Linear
submodule, so the ZeRO-3 hooks gather its parameters right before its forward and release them right
after (and again in backward): at most one tile is gathered at a time when each tile has its own bucket
(a tile of at least ``min_io_bytes`` per rank does). The result equals nn.Linear up to the order of the
fp32 additions (the tests hold it to 1e-6 relative).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn as nn

from ...errors import TierstoreValueError


def _split(n: int, parts: int, what: str) -> list[int]:
    if not isinstance(parts, int) or parts < 1 or parts > n:
        raise TierstoreValueError(f"{what}={parts!r} must be an integer in [1, {n}]")
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class _Tile(nn.Linear):
    """One tile: an nn.Linear initialised with the bounds of the whole layer (fan-in `layer_in`). It draws its
    own values in its own __init__ so that under zero.Init -- which offloads a module's parameters when that
    module's __init__ returns ([Note: when a module is offloaded]) -- the values stored are the final ones;
    a parent re-initialising its tiles afterwards would write into empty tensors."""

    def __init__(self, in_features: int, out_features: int, bias: bool, layer_in: int, device=None, dtype=None):
        self.layer_in = layer_in
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # nn.Linear's kaiming_uniform_(a=sqrt(5)) over fan_in = the whole layer's in_features: U(-1/sqrt(in), ..)
        bound = 1 / math.sqrt(self.layer_in) if self.layer_in else 0.0
        self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)


class TiledLinear(nn.Module):
    """Like nn.Linear(in_features, out_features, bias), as out_splits x in_splits tiles (``tiles[j][i]``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, in_splits: int = 1,
                 out_splits: int = 1, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_parts = _split(in_features, in_splits, "in_splits")
        self.out_parts = _split(out_features, out_splits, "out_splits")
        self.tiles = nn.ModuleList(
            nn.ModuleList(_Tile(i, o, bias and c == 0, in_features, device=device, dtype=dtype)
                          for c, i in enumerate(self.in_parts)) for o in self.out_parts)

    def _rows(self) -> Iterable[Iterable[_Tile]]:
        """The rows of tiles (self.tiles is a ModuleList of ModuleLists of _Tile)."""
        return cast("Iterable[Iterable[_Tile]]", self.tiles)

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation over the whole layer: bounds from in_features, not a tile's width (each
        tile draws its values when it is built; this draws them again)."""
        for row in self._rows():
            for lin in row:
                lin.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.split(self.in_parts, dim=-1)
        outs = []
        for row in self._rows():
            acc: torch.Tensor | None = None
            for lin, xi in zip(row, xs):
                y = lin(xi)
                acc = y if acc is None else acc + y
            assert acc is not None  # every row has at least one tile
            outs.append(acc)
        return torch.cat(outs, dim=-1)

    @torch.no_grad()
    def copy_from(self, linear: nn.Linear) -> TiledLinear:
        """Take the weights (and bias) of an nn.Linear of the same size."""
        if (linear.in_features, linear.out_features) != (self.in_features, self.out_features):
            raise TierstoreValueError(f"copy_from: nn.Linear is {linear.in_features}->{linear.out_features}, "
                                      f"this TiledLinear {self.in_features}->{self.out_features}")
        r0 = 0
        for row, o in zip(self._rows(), self.out_parts):
            c0 = 0
            for lin, i in zip(row, self.in_parts):
                lin.weight.copy_(linear.weight[r0:r0 + o, c0:c0 + i])
                if lin.bias is not None:
                    lin.bias.copy_(linear.bias[r0:r0 + o])
                c0 += i
            r0 += o
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, in_splits: int = 1, out_splits: int = 1) -> TiledLinear:
        t = cls(linear.in_features, linear.out_features, linear.bias is not None, in_splits=in_splits,
                out_splits=out_splits, device=linear.weight.device, dtype=linear.weight.dtype)
        return t.copy_from(linear)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tiles={len(self.out_parts)}x{len(self.in_parts)}")
