"""Bandwidth-centric partitioning: which bytes of which parameter every data-parallel rank keeps.

``plan(params, world_size)`` lays the parameters out in *buckets* (flat buffers of one dtype) and cuts every
bucket into ``world_size`` equal, aligned *shards*, one per rank. The layer is pure logic over shapes and
dtypes; the helpers that touch data (``flatten``, ``views``, ``shard``, ``reshard_shards``...) only slice and
copy torch tensors. docs/partition.md has the picture, the guarantees and the figures.

[Note: bandwidth-centric layout]
ZeRO-Infinity (Rajbhandari et al., SC'21, sec. 6.1 "bandwidth-centric partitioning") splits *every*
parameter over all data-parallel ranks and all-gathers it before use, instead of letting one owner broadcast
it: each rank then reads its 1/N from its own CPU memory or NVMe, in parallel, so the aggregate bandwidth
grows with N. Every bucket here is therefore sharded over every rank; a rank's shard of a bucket is one
contiguous range, so fetching a bucket costs each rank exactly one I/O request.

[Note: big aligned requests]
NVMe reaches its bandwidth only with large requests (>= ~1 MiB, see shared/research/deepspeed.md) and
O_DIRECT needs offsets and lengths aligned to the logical block (4 KiB here). DeepSpeed's swapper writes one
file per parameter per rank, so a 768-element bias at world 64 becomes a 48-byte request padded to 4 KiB.
Here consecutive small parameters of one dtype are packed into one bucket until each rank's shard reaches
``min_io_bytes`` (a last short bucket joins a neighbour rather than make a runt request), a parameter that
alone reaches it gets its own bucket, and one larger than ``bucket_bytes`` is cut over several buckets.
A bucket is padded (with zeros) to a multiple of ``world_size * alignment`` bytes, so every shard offset and
length is a multiple of ``alignment`` bytes; inside a bucket parameters are packed back to back, without
padding, so padding is paid once per bucket, never per parameter.

[Note: split parameters]
A parameter larger than ``bucket_bytes`` lives in several buckets and cannot be one view of one bucket.
``views`` therefore returns views of whole parameters only; ``pieces(name)``/``locate(name)`` say where every
piece of any parameter lives, ``unflatten_into`` copies a bucket's pieces (split or not) into parameter
tensors, and ``unflatten`` assembles every parameter from all buckets as new tensors. ``split_params`` lists
the parameters concerned (none unless a parameter exceeds the cap: 256 MiB by default up to 128 ranks).

Sizes are in elements of the bucket's dtype unless a name ends in ``bytes``.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._units import fmt_bytes
from .errors import TierstoreValueError

__all__ = ["Bucket", "Location", "ParamSpec", "Piece", "Plan", "PlanSummary", "ShardCopy", "plan",
           "reshard_copies", "reshard_shards"]

FORMAT = "tierstore.partition/1"  # to_dict's "format"; bump when the dict changes shape
DEFAULT_MIN_IO_BYTES = 1 << 20  # bytes
DEFAULT_ALIGNMENT = 4096  # bytes
DEFAULT_BUCKET_BYTES = 256 << 20  # bytes; the default cap grows to 2 * world_size * min_io_bytes when larger

ParamLike = torch.Tensor | tuple  # a tensor (only its shape and dtype are read) or (shape, dtype)


# ----------------------------------------------------------------------------------------------------------
# The layout's records


@dataclass(frozen=True)
class ParamSpec:
    """A parameter as the plan sees it: a name, a shape and a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:  # elements
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:  # bytes
        return self.numel * self.dtype.itemsize


class Piece(NamedTuple):
    """A contiguous run of one parameter's (flattened) elements stored contiguously in one bucket."""

    name: str
    bucket: int  # index into plan.buckets
    offset: int  # elements, from the start of the bucket
    param_offset: int  # elements, from the start of the flattened parameter
    numel: int  # elements

    @property
    def end(self) -> int:  # elements, one past the piece in the bucket
        return self.offset + self.numel


class Location(NamedTuple):
    """A run of a parameter's elements inside one rank's shard of one bucket (see ``Plan.locate``)."""

    bucket: int
    rank: int
    offset: int  # elements, from the start of the rank's shard
    param_offset: int  # elements, from the start of the flattened parameter
    numel: int  # elements


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of one dtype: ``pieces`` back to back from element 0, then zero padding up to ``numel``.

    Rank r's shard is elements ``[r * shard_numel, (r + 1) * shard_numel)``."""

    index: int
    dtype: torch.dtype
    numel: int  # elements, padding included; == world_size * shard_numel
    shard_numel: int  # elements per rank
    pieces: tuple[Piece, ...]
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(p.offset for p in self.pieces))

    @property
    def itemsize(self) -> int:  # bytes per element
        return self.dtype.itemsize

    @property
    def payload_numel(self) -> int:  # elements holding parameter data; the rest is padding
        return self.pieces[-1].end if self.pieces else 0

    @property
    def nbytes(self) -> int:  # bytes, padding included
        return self.numel * self.itemsize

    @property
    def shard_nbytes(self) -> int:  # bytes of one rank's shard: one I/O request
        return self.shard_numel * self.itemsize

    @property
    def payload_nbytes(self) -> int:  # bytes
        return self.payload_numel * self.itemsize

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)

    def shard_slice(self, rank: int) -> slice:
        """Rank `rank`'s shard as a slice of the flat bucket (elements)."""
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def overlapping(self, lo: int, hi: int) -> Iterable[tuple[Piece, int, int]]:
        """(piece, start, stop) for every piece meeting bucket elements [lo, hi), clipped to that range."""
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        for p in self.pieces[i:]:
            if p.offset >= hi:
                break
            if p.end > lo:
                yield p, max(p.offset, lo), min(p.end, hi)


class ShardCopy(NamedTuple):
    """Copy ``numel`` elements from a source shard to a destination shard (see ``reshard_copies``)."""

    src_bucket: int
    src_rank: int
    src_offset: int  # elements, from the start of the source rank's shard
    dst_bucket: int
    dst_rank: int
    dst_offset: int  # elements, from the start of the destination rank's shard
    numel: int  # elements


@dataclass(frozen=True)
class PlanSummary:
    """What a plan costs the I/O layer: one request per bucket per rank per step (a read, and a write back)."""

    world_size: int
    alignment: int  # bytes
    params: int
    buckets: int
    split_params: int
    requests_per_rank: int  # per step
    request_bytes_min: int  # bytes
    request_bytes_mean: float  # bytes
    request_bytes_max: int  # bytes
    rank_bytes: int  # bytes one rank stores: all its shards
    payload_bytes: int  # bytes of the model
    padding_bytes: int  # bytes of zeros the layout adds, all ranks together

    @property
    def padding_pct(self) -> float:  # padding as a percentage of the model's bytes
        return 100.0 * self.padding_bytes / self.payload_bytes if self.payload_bytes else 0.0

    def __str__(self) -> str:
        split = f"; {self.split_params} split over several buckets" if self.split_params else ""
        lines = [f"{self.params} parameters ({fmt_bytes(self.payload_bytes)}) in {self.buckets} buckets over "
                 f"{self.world_size} ranks{split}"]
        if self.requests_per_rank:
            lines.append(f"per rank per step: {self.requests_per_rank} requests of "
                         f"{fmt_bytes(self.request_bytes_min)} to {fmt_bytes(self.request_bytes_max)} "
                         f"(mean {fmt_bytes(self.request_bytes_mean)}), {fmt_bytes(self.rank_bytes)} in all")
        else:
            lines.append("per rank per step: no requests (the model has no elements)")
        lines.append(f"padding: {fmt_bytes(self.padding_bytes)} ({self.padding_pct:.2f}% of the model); "
                     f"every shard offset and length is a multiple of {self.alignment} bytes")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Building a plan


def plan(params: Mapping[str, ParamLike] | torch.nn.Module | Iterable[tuple[str, ParamLike]], world_size: int,
         *, min_io_bytes: int = DEFAULT_MIN_IO_BYTES, alignment: int = DEFAULT_ALIGNMENT,
         bucket_bytes: int | None = None) -> Plan:
    """Lay `params` out in buckets sharded over `world_size` ranks.

    params: an ordered mapping name -> (shape, dtype) or name -> tensor, an ``nn.Module`` (its
        ``named_parameters()``, tied parameters once), or an iterable of (name, tensor or (shape, dtype)).
        Only shapes and dtypes are read: meta tensors are fine.
    min_io_bytes: pack consecutive small parameters of a dtype until each rank's shard of their bucket holds
        at least this many bytes (less only where the model leaves no choice; see docs/partition.md).
    alignment: every shard offset and length is a multiple of this many bytes; a multiple of every itemsize.
    bucket_bytes: the most bytes one bucket (all ranks' shards, padding included) may hold; a parameter
        larger is cut over several buckets. Default: max(256 MiB, 2 * world_size * min_io_bytes).

    The result depends only on the arguments (same plan on every rank)."""
    specs = _param_specs(params)
    _check_options(world_size, min_io_bytes, alignment, bucket_bytes)
    for s in specs:
        if alignment % s.dtype.itemsize:
            raise TierstoreValueError(
                f"alignment={alignment} bytes is not a multiple of the {s.dtype.itemsize}-byte itemsize of "
                f"parameter {s.name!r} ({_dtype_name(s.dtype)}); use a multiple of it, e.g. 4096")
    cap = _cap_bytes(world_size, min_io_bytes, alignment, bucket_bytes)
    unit = world_size * alignment  # bytes: a bucket's size is a multiple of this
    buckets = _pack(specs, cap, target=min(world_size * min_io_bytes, cap), unit=unit)
    out = []
    for i, b in enumerate(buckets):
        numel = _ceil_div(b.numel * b.dtype.itemsize, unit) * unit // b.dtype.itemsize  # elements, padded
        pieces, offset = [], 0
        for name, param_offset, n in b.pieces:
            pieces.append(Piece(name, i, offset, param_offset, n))
            offset += n
        out.append(Bucket(i, b.dtype, numel, numel // world_size, tuple(pieces)))
    return Plan(world_size, specs, out, min_io_bytes=min_io_bytes, alignment=alignment, bucket_bytes=bucket_bytes)


def _pack(specs: list[ParamSpec], cap: int, target: int, unit: int) -> list[_Open]:
    """The buckets' contents, in model order of their first element.

    cap: bytes a bucket may hold; target: bytes of payload that give every rank a min_io_bytes shard;
    unit: bytes a bucket's size is a multiple of (world_size * alignment)."""
    buckets: list[_Open] = []  # in creation order
    open_: dict[torch.dtype, _Open] = {}  # the bucket still packing small parameters, per dtype
    last_packed: dict[torch.dtype, _Open] = {}  # the last full one, per dtype (for the tail, below)
    b: _Open | None
    for s in specs:
        item = s.dtype.itemsize
        n = s.numel
        if n == 0:
            continue  # no elements, no piece: `unflatten` still returns it (empty)
        if n * item >= target:
            # Large enough to give every rank a min_io_bytes shard alone: its own bucket(s). When it exceeds
            # the cap, cut it into k = ceil(bytes / cap) pieces of whole bucket units, as equal as units allow
            # (the larger ones last: the last piece carries the padding), so only the last bucket is padded
            # and every piece holds at least half a cap less one unit.
            unit_n = unit // item  # elements
            units = _ceil_div(n, unit_n)
            k = _ceil_div(units, cap // unit)
            start = 0
            for i in range(k):
                size = (units // k + (i >= k - units % k)) * unit_n
                b = _Open(s.dtype)
                b.add(s.name, start, min(size, n - start))
                buckets.append(b)
                start += size
            continue
        b = open_.get(s.dtype)
        if b is not None and (b.numel + n) * item > cap:  # would overflow: close it short of the target
            last_packed[s.dtype] = open_.pop(s.dtype)
            b = None
        if b is None:
            b = open_[s.dtype] = _Open(s.dtype)
            buckets.append(b)
        b.add(s.name, 0, n)
        if b.numel * item >= target:
            last_packed[s.dtype] = open_.pop(s.dtype)
    # The model ran out before a dtype's last packed bucket reached the target. Rather than leave a runt
    # request, its pieces join another bucket of the dtype that has room under the cap: the previous packed
    # one, else the nearest before it, else the nearest after it (pieces stay in model order inside it).
    order = {s.name: i for i, s in enumerate(specs)}

    def model_order(piece: tuple[str, int, int]) -> tuple[int, int]:
        return order[piece[0]], piece[1]

    for dtype, tail in open_.items():
        at = buckets.index(tail)
        before = [b for b in buckets[:at] if b.dtype == dtype]
        after = [b for b in buckets[at + 1:] if b.dtype == dtype]
        prev = [last_packed[dtype]] if dtype in last_packed else []
        for b in prev + before[::-1] + after:
            if (b.numel + tail.numel) * dtype.itemsize <= cap:
                b.pieces = sorted(b.pieces + tail.pieces, key=model_order)
                b.numel += tail.numel
                buckets.remove(tail)
                break
    # A tail that joined a later bucket moved that bucket's start.
    buckets.sort(key=lambda b: model_order(b.pieces[0]))
    return buckets


class _Open:
    """A bucket being filled: (name, param_offset, numel) runs of one dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.pieces: list[tuple[str, int, int]] = []
        self.numel = 0  # elements

    def add(self, name: str, param_offset: int, numel: int) -> None:
        self.pieces.append((name, param_offset, numel))
        self.numel += numel


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _cap_bytes(world_size: int, min_io_bytes: int, alignment: int, bucket_bytes: int | None) -> int:
    """The effective bucket cap: bucket_bytes (or its default) rounded down to a multiple of world*alignment."""
    unit = world_size * alignment
    if bucket_bytes is None:
        bucket_bytes = max(DEFAULT_BUCKET_BYTES, 2 * world_size * min_io_bytes, unit)
    return bucket_bytes // unit * unit


def _check_options(world_size, min_io_bytes, alignment, bucket_bytes) -> None:
    for name, value, least in (("world_size", world_size, 1), ("min_io_bytes", min_io_bytes, 0),
                               ("alignment", alignment, 1)):
        if not _is_int(value) or value < least:
            raise TierstoreValueError(f"{name}={value!r} must be an integer >= {least}")
    if bucket_bytes is not None:
        if not _is_int(bucket_bytes):
            raise TierstoreValueError(f"bucket_bytes={bucket_bytes!r} must be an integer (bytes) or None")
        if bucket_bytes < world_size * alignment:
            raise TierstoreValueError(
                f"bucket_bytes={bucket_bytes} cannot hold one aligned shard per rank: it must be at least "
                f"world_size * alignment = {world_size} * {alignment} = {world_size * alignment} bytes; "
                f"raise it (or pass None for the default)")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _param_specs(params) -> list[ParamSpec]:
    items: Iterable[Any]
    if isinstance(params, torch.nn.Module):
        items = params.named_parameters()
    elif isinstance(params, Mapping):
        items = params.items()
    elif isinstance(params, (str, bytes, torch.Tensor)) or not isinstance(params, Iterable):
        raise TierstoreValueError(
            f"params must be a mapping name -> (shape, dtype), an nn.Module or an iterable of (name, param); "
            f"got {type(params).__name__}")
    else:
        items = params
    specs, seen = [], set()
    for item in items:
        try:
            name, p = item
        except (TypeError, ValueError):
            raise TierstoreValueError(f"params yielded {item!r}; each item must be a pair (name, param)") from None
        if not isinstance(name, str):
            raise TierstoreValueError(f"parameter name {name!r} must be a str")
        if name in seen:
            raise TierstoreValueError(f"parameter {name!r} appears twice; names must be unique")
        seen.add(name)
        if isinstance(p, torch.Tensor):
            shape, dtype = tuple(p.shape), p.dtype
        else:
            try:
                shape, dtype = p
                shape = tuple(shape)
            except (TypeError, ValueError):
                raise TierstoreValueError(
                    f"parameter {name!r}: {p!r} is neither a tensor nor a pair (shape, dtype)") from None
            dtype = _dtype(dtype, f"parameter {name!r}")
        if not all(_is_int(d) and d >= 0 for d in shape):
            raise TierstoreValueError(f"parameter {name!r}: shape {shape!r} must be a sequence of integers >= 0")
        specs.append(ParamSpec(name, tuple(int(d) for d in shape), dtype))
    return specs


def _dtype(d, what: str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if isinstance(d, str):
        found = getattr(torch, d.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise TierstoreValueError(f"{what}: dtype {d!r} is not a torch.dtype nor the name of one (e.g. 'bfloat16')")


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------------
# The plan


class Plan:
    """A layout of parameters in buckets sharded over ranks. Build it with ``plan()`` or ``Plan.from_dict``.

    Attributes: ``world_size``; ``alignment``, ``min_io_bytes`` and ``bucket_bytes`` (bytes; the effective
    cap); ``params`` (name -> ParamSpec, model order); ``buckets`` (tuple of Bucket, index order)."""

    def __init__(self, world_size: int, params: Sequence[ParamSpec], buckets: Sequence[Bucket], *,
                 min_io_bytes: int, alignment: int, bucket_bytes: int | None):
        _check_options(world_size, min_io_bytes, alignment, bucket_bytes)
        self.world_size = world_size
        self.min_io_bytes = min_io_bytes  # bytes
        self.alignment = alignment  # bytes
        self._bucket_bytes_arg = bucket_bytes  # None: the default, recomputed by reshard for the new world
        self.params: dict[str, ParamSpec] = {s.name: s for s in params}
        if len(self.params) != len(params):
            raise TierstoreValueError("parameter names must be unique")
        self.buckets: tuple[Bucket, ...] = tuple(buckets)
        pieces: dict[str, list[Piece]] = {name: [] for name in self.params}
        for b in self.buckets:
            for p in b.pieces:
                if p.name not in pieces:
                    raise TierstoreValueError(f"bucket {b.index} holds {p.name!r}, which is not a parameter")
                pieces[p.name].append(p)
        self._pieces = {name: tuple(sorted(ps, key=lambda p: p.param_offset)) for name, ps in pieces.items()}
        self._validate()

    def _validate(self) -> None:
        """Every invariant the docs promise; from_dict relies on it to refuse a damaged layout."""
        for i, b in enumerate(self.buckets):
            where = f"bucket {i}"
            if b.index != i:
                raise TierstoreValueError(f"{where} says it is bucket {b.index}")
            if not b.pieces:
                raise TierstoreValueError(f"{where} holds no parameter")
            if b.numel != b.shard_numel * self.world_size or (b.shard_numel * b.itemsize) % self.alignment:
                raise TierstoreValueError(
                    f"{where}: {b.numel} elements in shards of {b.shard_numel} do not make {self.world_size} "
                    f"equal shards of a multiple of {self.alignment} bytes")
            offset = 0
            for p in b.pieces:
                spec = self.params[p.name]
                if not all(_is_int(x) for x in (p.bucket, p.offset, p.param_offset, p.numel)):
                    raise TierstoreValueError(f"{where}: piece {p} has a position that is not an integer")
                if p.bucket != i or p.offset != offset or p.numel <= 0 or spec.dtype != b.dtype:
                    raise TierstoreValueError(f"{where}: piece {p} is not packed after the previous one in a "
                                              f"{_dtype_name(b.dtype)} bucket")
                offset = p.end
            if offset > b.numel:
                raise TierstoreValueError(f"{where}: {offset} elements of pieces overflow its {b.numel}")
        for name, ps in self._pieces.items():
            at = 0
            for p in ps:
                if p.param_offset != at:
                    raise TierstoreValueError(f"parameter {name!r}: its pieces do not cover it exactly once "
                                              f"(element {at} expected, piece starts at {p.param_offset})")
                at += p.numel
            if at != self.params[name].numel:
                raise TierstoreValueError(f"parameter {name!r}: pieces hold {at} of {self.params[name].numel} "
                                          f"elements")

    # -- the layout ---------------------------------------------------------------------------------------

    @property
    def bucket_bytes(self) -> int:  # bytes: the effective cap on a bucket's size
        return _cap_bytes(self.world_size, self.min_io_bytes, self.alignment, self._bucket_bytes_arg)

    @property
    def split_params(self) -> tuple[str, ...]:
        """Parameters stored in more than one bucket (no single view exists for them)."""
        return tuple(name for name, ps in self._pieces.items() if len(ps) > 1)

    def pieces(self, name: str) -> tuple[Piece, ...]:
        """Where parameter `name` lives, bucket by bucket, in parameter order (empty for an empty parameter)."""
        return self._pieces[self._name(name)]

    def locate(self, name: str) -> list[Location]:
        """Every (bucket, rank, offset in the rank's shard) run of parameter `name`, in parameter order."""
        out = []
        for p in self.pieces(name):
            s = self.buckets[p.bucket].shard_numel
            lo = p.offset
            while lo < p.end:
                rank = lo // s
                hi = min(p.end, (rank + 1) * s)
                out.append(Location(p.bucket, rank, lo - rank * s, p.param_offset + lo - p.offset, hi - lo))
                lo = hi
        return out

    def shard_slice(self, rank: int, bucket: int | Bucket) -> slice:
        """Rank `rank`'s shard of `bucket` as a slice of the flat bucket (elements)."""
        return self._bucket(bucket).shard_slice(self._rank(rank))

    @property
    def rank_bytes(self) -> int:
        """Bytes one rank stores: its shard of every bucket (the same for every rank)."""
        return sum(b.shard_nbytes for b in self.buckets)

    # -- tensors ------------------------------------------------------------------------------------------

    def shard(self, bucket_tensor: torch.Tensor, bucket: int | Bucket, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of a flat bucket tensor, as a view."""
        b = self._bucket(bucket)
        self._check_buffer(bucket_tensor, b.numel, b.dtype, f"bucket {b.index}")
        return bucket_tensor[b.shard_slice(self._rank(rank))]

    def flatten(self, tensors: Mapping[str, torch.Tensor], bucket: int | Bucket, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat bucket tensor: its pieces copied from `tensors` (name -> parameter), padding zeroed.

        `tensors` must hold every parameter with a piece in the bucket; a new tensor is made on the device
        of the first of them unless `out` (1-D, the bucket's numel and dtype) is given."""
        b = self._bucket(bucket)
        return self._fill(tensors, b, 0, b.numel, out, f"bucket {b.index}")

    def flatten_shard(self, tensors: Mapping[str, torch.Tensor], bucket: int | Bucket, rank: int, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank `rank`'s shard of the bucket, built straight from the parameters (never the whole bucket);
        equal to ``shard(flatten(tensors, bucket), bucket, rank)``."""
        b = self._bucket(bucket)
        s = b.shard_slice(self._rank(rank))
        return self._fill(tensors, b, s.start, s.stop, out, f"rank {rank}'s shard of bucket {b.index}")

    def views(self, bucket_tensor: torch.Tensor, bucket: int | Bucket) -> dict[str, torch.Tensor]:
        """name -> view (with the parameter's shape) for every parameter held *whole* by this bucket.

        Writing to a view writes the bucket. A split parameter (see ``split_params``) has no view: use
        ``unflatten_into`` or ``unflatten``."""
        b = self._bucket(bucket)
        self._check_buffer(bucket_tensor, b.numel, b.dtype, f"bucket {b.index}")
        return {p.name: bucket_tensor[p.offset:p.end].view(self.params[p.name].shape)
                for p in b.pieces if len(self._pieces[p.name]) == 1}

    def unflatten_into(self, bucket_tensor: torch.Tensor, bucket: int | Bucket,
                       tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy every piece of the bucket (whole parameters and pieces of split ones) into `tensors`
        (name -> contiguous parameter tensor), in place."""
        b = self._bucket(bucket)
        self._check_buffer(bucket_tensor, b.numel, b.dtype, f"bucket {b.index}")
        for p in b.pieces:
            dst = self._param_tensor(tensors, p.name, f"bucket {b.index}")
            if not dst.is_contiguous():
                raise TierstoreValueError(f"parameter {p.name!r} is not contiguous; unflatten_into writes "
                                          f"in place, so pass a contiguous tensor")
            dst.view(-1)[p.param_offset:p.param_offset + p.numel].copy_(bucket_tensor[p.offset:p.end])

    def unflatten(self, bucket_tensors: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        """Every parameter (model order) as a new tensor assembled from all the flat bucket tensors."""
        if len(bucket_tensors) != len(self.buckets):
            raise TierstoreValueError(f"unflatten needs all {len(self.buckets)} buckets, got "
                                      f"{len(bucket_tensors)}")
        device = bucket_tensors[0].device if self.buckets else torch.device("cpu")
        out = {name: torch.empty(s.shape, dtype=s.dtype, device=device) for name, s in self.params.items()}
        for b in self.buckets:
            self.unflatten_into(bucket_tensors[b.index], b, out)
        return out

    # -- resharding and serialisation ---------------------------------------------------------------------

    def reshard(self, new_world_size: int, **options) -> Plan:
        """The plan of the same parameters over `new_world_size` ranks (options default to this plan's).

        Move data saved under this plan with ``reshard_shards(self, new_plan, ...)``."""
        kw: dict[str, Any] = dict(min_io_bytes=self.min_io_bytes, alignment=self.alignment,
                                  bucket_bytes=self._bucket_bytes_arg)
        unknown = set(options) - set(kw)
        if unknown:
            raise TierstoreValueError(f"reshard got unknown options {sorted(unknown)}; it takes {sorted(kw)}")
        kw.update(options)
        return plan({n: (s.shape, s.dtype) for n, s in self.params.items()}, new_world_size, **kw)

    def summary(self) -> PlanSummary:
        sizes = [b.shard_nbytes for b in self.buckets]
        payload = sum(s.nbytes for s in self.params.values())
        return PlanSummary(
            world_size=self.world_size, alignment=self.alignment, params=len(self.params),
            buckets=len(self.buckets), split_params=len(self.split_params), requests_per_rank=len(sizes),
            request_bytes_min=min(sizes, default=0), request_bytes_mean=sum(sizes) / len(sizes) if sizes else 0.0,
            request_bytes_max=max(sizes, default=0), rank_bytes=sum(sizes), payload_bytes=payload,
            padding_bytes=sum(b.nbytes for b in self.buckets) - payload)

    def to_dict(self) -> dict:
        """A JSON-able description that ``from_dict`` turns back into an equal plan (layout included, so a
        checkpoint keeps its layout even if the planning rules change)."""
        return {
            "format": FORMAT,
            "world_size": self.world_size,
            "min_io_bytes": self.min_io_bytes,
            "alignment": self.alignment,
            "bucket_bytes": self._bucket_bytes_arg,
            "params": [[s.name, list(s.shape), _dtype_name(s.dtype)] for s in self.params.values()],
            "buckets": [{"dtype": _dtype_name(b.dtype), "numel": b.numel,
                         "pieces": [[p.name, p.param_offset, p.numel] for p in b.pieces]} for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        """The plan ``to_dict`` described; a damaged description raises TierstoreValueError."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise TierstoreValueError(f"not a partition plan of format {FORMAT!r} (got {got!r})")
        try:
            world = d["world_size"]
            specs = _param_specs([(name, (shape, dtype)) for name, shape, dtype in d["params"]])
            buckets = []
            for i, b in enumerate(d["buckets"]):
                pieces, offset = [], 0
                for name, param_offset, numel in b["pieces"]:
                    pieces.append(Piece(name, i, offset, param_offset, numel))
                    offset += numel
                numel = b["numel"]
                if not _is_int(numel) or not _is_int(world) or world < 1:
                    raise TierstoreValueError(f"bucket {i}: numel {numel!r} / world_size {world!r} are not integers")
                buckets.append(Bucket(i, _dtype(b["dtype"], f"bucket {i}"), numel, numel // world, tuple(pieces)))
            return cls(world, specs, buckets, min_io_bytes=d["min_io_bytes"], alignment=d["alignment"],
                       bucket_bytes=d["bucket_bytes"])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, TierstoreValueError):
                raise
            raise TierstoreValueError(f"damaged partition plan: {type(e).__name__}: {e}") from None

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # compared by value, and not immutable

    def __repr__(self) -> str:
        return (f"Plan(world_size={self.world_size}, params={len(self.params)}, buckets={len(self.buckets)}, "
                f"alignment={self.alignment}, min_io_bytes={self.min_io_bytes}, bucket_bytes={self.bucket_bytes})")

    def __str__(self) -> str:
        return str(self.summary())

    # -- helpers ------------------------------------------------------------------------------------------

    def _bucket(self, bucket: int | Bucket) -> Bucket:
        i = bucket.index if isinstance(bucket, Bucket) else bucket
        if not _is_int(i) or not 0 <= i < len(self.buckets):
            raise TierstoreValueError(f"bucket {bucket!r} is not one of this plan's {len(self.buckets)} buckets")
        return self.buckets[i]

    def _rank(self, rank: int) -> int:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise TierstoreValueError(f"rank {rank!r} is not in [0, {self.world_size})")
        return rank

    def _name(self, name: str) -> str:
        if name not in self.params:
            raise TierstoreValueError(f"{name!r} is not a parameter of this plan")
        return name

    @staticmethod
    def _check_buffer(t: torch.Tensor, numel: int, dtype: torch.dtype, what: str) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != numel or t.dtype != dtype:
            got = (f"{tuple(t.shape)} {_dtype_name(t.dtype)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise TierstoreValueError(f"{what} must be a 1-D {_dtype_name(dtype)} tensor of {numel} elements; "
                                      f"got {got}")

    def _param_tensor(self, tensors: Mapping[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
        t = tensors.get(name)
        s = self.params[name]
        if t is None:
            raise TierstoreValueError(f"{what} holds parameter {name!r}; pass it in the tensors mapping")
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise TierstoreValueError(f"parameter {name!r} is {tuple(t.shape)} {_dtype_name(t.dtype)}; the plan "
                                      f"says {s.shape} {_dtype_name(s.dtype)}")
        return t

    def _fill(self, tensors, b: Bucket, lo: int, hi: int, out, what: str) -> torch.Tensor:
        """Bucket elements [lo, hi) gathered from the parameter tensors into `out` (made if None).

        Only the parameters meeting [lo, hi) are needed; a new `out` goes on the device of the first of them
        (of any tensor given when [lo, hi) is all padding)."""
        runs = [(p, start, stop, self._param_tensor(tensors, p.name, what))
                for p, start, stop in b.overlapping(lo, hi)]
        if out is None:
            device = runs[0][3].device if runs else next(iter(tensors.values()), torch.empty(0)).device
            out = torch.empty(hi - lo, dtype=b.dtype, device=device)
        else:
            self._check_buffer(out, hi - lo, b.dtype, f"out ({what})")
        for p, start, stop, t in runs:
            at = p.param_offset + start - p.offset
            out[start - lo:stop - lo].copy_(t.reshape(-1)[at:at + stop - start])
        out[min(max(b.payload_numel, lo), hi) - lo:].zero_()
        return out


# ----------------------------------------------------------------------------------------------------------
# Resharding: data saved under one plan, read under another


def reshard_copies(src: Plan, dst: Plan, *, dst_ranks: Iterable[int] | None = None) -> list[ShardCopy]:
    """The copies that move every parameter element from `src`'s shards to `dst`'s shards.

    Works for any two plans of the same parameters (another world size, alignment or bucket size, or a plan
    from an older version). Restricted to the shards of `dst_ranks` (default: all), each element of theirs is
    written exactly once; runs contiguous on both sides are merged, so a rank reads a few large ranges of a
    few source shards. Sorted by (src_bucket, src_rank, src_offset): each source shard is needed once."""
    _check_same_params(src, dst)
    wanted = None if dst_ranks is None else {dst._rank(r) for r in dst_ranks}
    raw: list[ShardCopy] = []
    for name in src.params:
        sp, dp = src.pieces(name), dst.pieces(name)
        i = j = 0
        while i < len(sp) and j < len(dp):
            a, c = sp[i], dp[j]
            lo = max(a.param_offset, c.param_offset)
            hi = min(a.param_offset + a.numel, c.param_offset + c.numel)
            s_at = a.offset + lo - a.param_offset  # elements into the source bucket
            d_at = c.offset + lo - c.param_offset  # elements into the destination bucket
            ss, ds = src.buckets[a.bucket].shard_numel, dst.buckets[c.bucket].shard_numel
            n = hi - lo
            while n > 0:
                sr, dr = s_at // ss, d_at // ds
                m = min(n, (sr + 1) * ss - s_at, (dr + 1) * ds - d_at)
                if wanted is None or dr in wanted:
                    raw.append(ShardCopy(a.bucket, sr, s_at - sr * ss, c.bucket, dr, d_at - dr * ds, m))
                s_at, d_at, n = s_at + m, d_at + m, n - m
            if a.param_offset + a.numel == hi:
                i += 1
            if c.param_offset + c.numel == hi:
                j += 1
    raw.sort(key=lambda c: (c.src_bucket, c.src_rank, c.src_offset))
    merged: list[ShardCopy] = []
    for cp in raw:
        last = merged[-1] if merged else None
        if (last is not None and (last.src_bucket, last.src_rank, last.dst_bucket, last.dst_rank)
                == (cp.src_bucket, cp.src_rank, cp.dst_bucket, cp.dst_rank)
                and last.src_offset + last.numel == cp.src_offset and last.dst_offset + last.numel == cp.dst_offset):
            merged[-1] = ShardCopy(last.src_bucket, last.src_rank, last.src_offset, last.dst_bucket, last.dst_rank,
                                   last.dst_offset, last.numel + cp.numel)
        else:
            merged.append(cp)
    return merged


def reshard_shards(src: Plan, dst: Plan,
                   shards: Mapping[tuple[int, int], torch.Tensor] | Callable[[int, int], torch.Tensor], *,
                   dst_ranks: Iterable[int] | None = None, device: torch.device | str = "cpu"
                   ) -> dict[tuple[int, int], torch.Tensor]:
    """Build `dst`'s shards of `dst_ranks` (default: all) from shards saved under `src`.

    shards: (bucket, rank) -> that rank's 1-D shard of that bucket under `src`, as a mapping or a function
    (called once per source shard actually needed, in order; e.g. a file read). Returns
    (bucket, rank) -> new shard under `dst` for every bucket and every requested rank, padding zeroed."""
    ranks = range(dst.world_size) if dst_ranks is None else sorted({dst._rank(r) for r in dst_ranks})
    copies = reshard_copies(src, dst, dst_ranks=ranks)
    out = {(b.index, r): torch.zeros(b.shard_numel, dtype=b.dtype, device=device)
           for b in dst.buckets for r in ranks}
    load = shards if callable(shards) else (lambda bucket, rank: shards[bucket, rank])
    key: tuple[int, int] | None = None
    shard: Any = None  # the source shard of `key`
    for c in copies:  # sorted by source shard: each is loaded once
        if key != (c.src_bucket, c.src_rank):
            key = (c.src_bucket, c.src_rank)
            b = src.buckets[c.src_bucket]
            shard = load(*key)
            src._check_buffer(shard, b.shard_numel, b.dtype, f"source shard (bucket {key[0]}, rank {key[1]})")
        out[c.dst_bucket, c.dst_rank][c.dst_offset:c.dst_offset + c.numel].copy_(
            shard[c.src_offset:c.src_offset + c.numel])
    return out


def _check_same_params(src: Plan, dst: Plan) -> None:
    if src.params.keys() != dst.params.keys():
        diff = sorted(src.params.keys() ^ dst.params.keys())
        raise TierstoreValueError(f"the plans hold different parameters (e.g. {diff[:3]}); reshard only maps "
                                  f"a layout of the same parameters")
    for name, s in src.params.items():
        if dst.params[name] != s:
            raise TierstoreValueError(f"parameter {name!r} is {s.shape} {_dtype_name(s.dtype)} in the source plan "
                                      f"but {dst.params[name].shape} {_dtype_name(dst.params[name].dtype)} in "
                                      f"the destination")
