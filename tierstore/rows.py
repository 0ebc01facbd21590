"""What `rows=` of Store.get accepts, turned into the rows of a tensor to read.

[Note: what rows accepts]
`rows` selects rows along dim 0, as indexing the tensor would, and nothing else is guessed at:
- a slice of ints (negative counted from the end; any non-zero step), or a range;
- row indices: a list or tuple of ints (Python or numpy integers), a 1-D integer tensor or numpy array, in any
  order, repeats allowed, negative ones counted from the end;
- a mask: a list, tensor or numpy array of bools with exactly one value per row, selecting the rows where it
  is True, in order (as torch and numpy index with a mask).
Anything else is refused with a TierstoreValueError naming `rows` and what to pass: a float (0.5 is no row),
a list mixing bools and ints (torch would read True as row 1), a mask of another length than the rows, a
nested list, a string, an unordered set, a 0-d tensor, a bare int.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy
import torch

from .errors import TierstoreValueError


def _accepts(n: int) -> str:
    return (f"pass a slice, a list of int row indices, a 1-D integer tensor, or a mask of {n} bools (one per "
            "row)")


def row_index(rows, shape: torch.Size, name: str) -> tuple[int, int] | torch.Tensor:
    """`rows` ([Note: what rows accepts]) of a tensor of `shape` as (start, stop) for a slice of step 1, else
    a LongTensor of row indices in [0, shape[0]). TierstoreValueError names what is wrong."""
    if len(shape) == 0:
        raise TierstoreValueError(f"rows= of {name!r}: a 0-d tensor has no rows; read it with get({name!r})")
    n = shape[0]

    def refuse(what: str) -> TierstoreValueError:
        return TierstoreValueError(f"rows= of {name!r}: {what}; {_accepts(n)}")

    if isinstance(rows, slice):
        try:
            start, stop, step = rows.indices(n)
        except (TypeError, ValueError) as e:
            raise refuse(f"the slice {rows!r} is not one of ints with a non-zero step ({e})") from None
        if step == 1:
            return start, max(start, stop)
        return torch.arange(start, stop, step, dtype=torch.long)
    if isinstance(rows, range):
        for r in (rows[0], rows[-1]) if len(rows) else ():
            if not -n <= r < n:
                raise TierstoreValueError(f"rows= of {name!r}: row {r} is outside its {n} rows (shape "
                                          f"{tuple(shape)})")
        index = torch.arange(rows.start, rows.stop, rows.step, dtype=torch.long)
    elif isinstance(rows, (torch.Tensor, numpy.ndarray)):
        index = _from_array(rows, n, refuse)
    elif isinstance(rows, (str, bytes, bytearray, set, frozenset, Mapping)) or not isinstance(rows, Iterable):
        one = f" (for the one row {rows}, pass [{rows}])" if isinstance(rows, int) and not isinstance(rows, bool) \
            else ""
        raise refuse(f"got {rows!r:.60} ({type(rows).__name__}){one}")
    else:
        index = _from_sequence(list(rows), n, refuse)
    bad = (index < -n) | (index >= n)
    if bool(bad.any()):
        raise TierstoreValueError(f"rows= of {name!r}: row {int(index[bad][0])} is outside its {n} rows "
                                  f"(shape {tuple(shape)})")
    return torch.where(index < 0, index + n, index)


def _mask(mask: torch.Tensor, n: int, refuse) -> torch.Tensor:
    if mask.numel() != n:
        raise refuse(f"a mask of {mask.numel()} bools for a tensor of {n} rows (a mask has one per row)")
    return torch.nonzero(mask).flatten()


def _from_array(rows, n: int, refuse) -> torch.Tensor:
    """Indices of a tensor or numpy array `rows` (integers, or a bool mask)."""
    if rows.ndim != 1:
        raise refuse(f"got a {type(rows).__name__} of shape {tuple(rows.shape)}, not 1-D")
    if isinstance(rows, numpy.ndarray):
        if rows.dtype.kind not in "biu":
            raise refuse(f"got a numpy array of {rows.dtype}")
        if rows.dtype.kind == "u" and rows.size and int(rows.max()) >= 1 << 63:
            raise refuse(f"row {int(rows.max())} is outside its {n} rows")
        rows = torch.from_numpy(rows.astype(numpy.bool_ if rows.dtype.kind == "b" else numpy.int64))
    if rows.dtype == torch.bool:
        return _mask(rows.to("cpu"), n, refuse)
    if rows.dtype.is_floating_point or rows.dtype.is_complex:
        raise refuse(f"got a tensor of {rows.dtype}")
    return rows.to("cpu", torch.long)


def _from_sequence(rows: list, n: int, refuse) -> torch.Tensor:
    """Indices of a list of ints, or of a list of bools (a mask)."""
    if not rows:
        return torch.empty(0, dtype=torch.long)
    types = set(map(type, rows))
    if types == {int}:  # the common case, in one call
        try:
            return torch.tensor(rows, dtype=torch.long)
        except (OverflowError, RuntimeError, ValueError):
            raise refuse(f"row {max(rows, key=abs)} is outside its {n} rows") from None
    bools = {t for t in types if issubclass(t, (bool, numpy.bool_))}
    if bools == types:
        return _mask(torch.tensor([bool(x) for x in rows]), n, refuse)
    if bools:
        raise refuse("got a list mixing bools and ints (a bool is no row index)")
    index = []
    for x in rows:
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point and \
                not x.dtype.is_complex and x.dtype != torch.bool:
            index.append(int(x))
            continue
        try:
            index.append(x.__index__())
        except (AttributeError, TypeError):
            raise refuse(f"got {x!r} ({type(x).__name__}), which is no row index") from None
    if max(index) >= 1 << 63 or min(index) < -(1 << 63):
        raise refuse(f"row {max(index, key=abs)} is outside its {n} rows")
    return torch.tensor(index, dtype=torch.long)
