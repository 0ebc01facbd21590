"""Quantized collectives of ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training", 2023): qwZ, an int8 all-gather of weights, and qgZ, a hierarchical all-to-all
reduce-scatter of gradients in int4 (or int8).

[Note: qgZ]
A ring reduce-scatter would requantize at every hop and accumulate error in low precision. qgZ instead
does two all-to-alls and reduces in fp32 after each (ZeRO++ sec. 3.3). Ranks are numbered node-major:
rank = node * L + local, L = intra_node_size, K = world / L nodes; rank r owns shard r (numel / world).
  1. reorder: view the tensor as [K, L, S] and swap to [L, K, S], so the slice for local peer l holds the
     K shards that end on ranks (k * L + l) -- the peer that aggregates them inside this node;
  2. quantize each peer's slice, all-to-all inside the node, dequantize, sum in fp32 -> [K, S];
  3. quantize each node's row, all-to-all across nodes among ranks with the same local index, dequantize,
     sum in fp32 -> this rank's shard [S]; divide by world for op="avg".
A rank's own contribution never goes through a quantizer (it is not sent). Every slice is quantized as its
own tensor (blocks never straddle two destinations). Error bound (docs/quant.md): with e the scheme's
bound (1/14 int4, 1/254 int8) and A_b the absmax of the block that carried a term,
|y^ - y| <= sum over the quantized terms of e x A_b (before the 1/world of "avg").

[Note: traffic]
``traffic()`` counts the payload bytes this process sent to other ranks (its own slices excluded), per
collective: qwZ sends its packed shard to world - 1 ranks (what each rank forwards in a ring all-gather),
qgZ sends (L - 1) node slices and (K - 1) row slices; all_gather_packed (hpZ's int8 secondary partition,
zero/hooks/hpz.py) sends its payload to the group's size - 1 ranks. The fp16 references are (world - 1) x shard x 2
bytes for both an all-gather and a reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import TierstoreValueError
from . import packed
from .layout import DEFAULT_BLOCK, check_block_size
from .quantized import Quantized, dequantize, quantize
from .schemes import get


@dataclass
class Traffic:
    """Payload bytes this process sent to other ranks, and how many calls."""

    bytes_sent: int = 0  # bytes
    calls: int = 0


_TRAFFIC: dict[str, Traffic] = {"all_gather_quantized": Traffic(), "all_gather_packed": Traffic(),
                               "reduce_scatter_quantized": Traffic()}


def traffic() -> dict[str, Traffic]:
    """Bytes sent so far by each quantized collective in this process. See [Note: traffic]."""
    return {k: Traffic(v.bytes_sent, v.calls) for k, v in _TRAFFIC.items()}


def reset_traffic() -> None:
    for v in _TRAFFIC.values():
        v.bytes_sent = v.calls = 0


def fp16_all_gather_bytes(shard_numel: int, world: int) -> int:
    """Bytes one rank sends in an fp16 ring all-gather of ``shard_numel`` elements per rank."""
    return (world - 1) * shard_numel * 2


def fp16_reduce_scatter_bytes(numel: int, world: int) -> int:
    """Bytes one rank sends in an fp16 reduce-scatter of ``numel`` elements (ring or direct)."""
    return (world - 1) * (numel // world) * 2


def payload_nbytes(scheme: str, numel: int, block_size: int) -> int:
    """Bytes of one slice on the wire: a packed buffer (packed.py, [Note: packed layout])."""
    return packed.nbytes(scheme, numel, block_size)


def _pack_into(x: torch.Tensor, buf: torch.Tensor, scheme: str, block_size: int) -> None:
    quantize(x, scheme, block_size, out=Quantized.packed(buf, scheme, x.numel(), block_size))


def all_gather_quantized(shard: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                         block_size: int = DEFAULT_BLOCK, out: torch.Tensor | None = None, async_op: bool = False,
                         scheme: str = "int8"):
    """qwZ: block-quantize this rank's ``shard`` (int8 as in ZeRO++, or another signed ``scheme``), all-gather
    codes and scales, dequantize on every rank.

    Every rank passes a shard of the same numel. Returns (or fills ``out``, contiguous, world x numel
    elements, fp32/bf16/fp16) the concatenation in rank order; rank r's part is within error_bound(scheme) x
    absmax_b of its shard (per block b; absmax_b / 254 for int8). ``async_op=True``: the shard is quantized
    and the collective posted now (its place in the sequence of collectives is now), and a handle is returned
    whose ``wait()`` dequantizes into ``out`` and returns it -- the same bytes as the synchronous call."""
    _check_signed(scheme, "qwZ quantizes weights")
    check_block_size(block_size)
    world = dist.get_world_size(group)
    n = shard.numel()
    if out is None:
        out = torch.empty(world * n, dtype=shard.dtype)
    elif out.numel() != world * n or not out.is_contiguous():
        raise TierstoreValueError(f"out must be contiguous with world x shard = {world * n} elements; got "
                                  f"{out.numel()}")
    send = pack_pieces(shard.reshape(-1), 1, scheme=scheme, block_size=block_size)
    return _gather_packed(send, group, n, out, scheme, block_size, async_op, "all_gather_quantized")


def pack_pieces(x: torch.Tensor, pieces: int, *, scheme: str = "int8", block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``x`` (flat, numel divisible by ``pieces``) cut into ``pieces`` equal runs, each packed as qwZ packs a
    shard (blocks start at each run's first element): uint8, pieces x payload_nbytes(scheme, run, block_size)
    bytes. What all_gather_packed sends."""
    _check_signed(scheme, "qwZ quantizes weights")
    check_block_size(block_size)
    if x.numel() % pieces:
        raise TierstoreValueError(f"pack_pieces: {x.numel()} elements do not split into {pieces} equal runs")
    n = x.numel() // pieces
    pn = payload_nbytes(scheme, n, block_size)
    buf = torch.empty(pieces * pn, dtype=torch.uint8)
    flat = x.reshape(-1)
    for i in range(pieces):
        _pack_into(flat[i * n:(i + 1) * n], buf[i * pn:(i + 1) * pn], scheme, block_size)
    return buf


def all_gather_packed(payload: torch.Tensor, group: dist.ProcessGroup | None = None, *, piece_numel: int,
                      out: torch.Tensor, async_op: bool = False, scheme: str = "int8",
                      block_size: int = DEFAULT_BLOCK):
    """The collective half of all_gather_quantized for payloads packed ahead of time (pack_pieces, e.g. hpZ's
    int8 secondary partition): every rank's ``payload`` (the same number of pieces of ``piece_numel``
    elements each) all-gathered and dequantized into ``out`` (contiguous, world x pieces x piece_numel), in
    rank order. ``async_op``: as in all_gather_quantized."""
    _check_signed(scheme, "qwZ quantizes weights")
    check_block_size(block_size)
    pn = payload_nbytes(scheme, piece_numel, block_size)
    if payload.dtype != torch.uint8 or payload.numel() % pn:
        raise TierstoreValueError(f"payload must be uint8 pieces of {pn} bytes (pack_pieces); got "
                                  f"{payload.numel()} x {payload.dtype}")
    pieces = payload.numel() // pn
    world = dist.get_world_size(group)
    if out.numel() != world * pieces * piece_numel or not out.is_contiguous():
        raise TierstoreValueError(f"out must be contiguous with world x pieces x piece_numel = "
                                  f"{world * pieces * piece_numel} elements; got {out.numel()}")
    return _gather_packed(payload, group, piece_numel, out, scheme, block_size, async_op, "all_gather_packed")


def _gather_packed(send: torch.Tensor, group, n: int, out: torch.Tensor, scheme: str, block_size: int,
                   async_op: bool, key: str):
    """All-gather the packed pieces of ``n`` elements in ``send`` and dequantize them into ``out``, in order."""
    world = dist.get_world_size(group)
    pn = payload_nbytes(scheme, n, block_size)
    recv = torch.empty(world * send.numel(), dtype=torch.uint8)
    work = dist.all_gather_into_tensor(recv, send, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        flat = out.view(-1)
        for r in range(recv.numel() // pn):
            dequantize(Quantized.packed(recv[r * pn:(r + 1) * pn], scheme, n, block_size),
                       out=flat[r * n:(r + 1) * n])
        t = _TRAFFIC[key]
        t.bytes_sent += (world - 1) * send.numel()
        t.calls += 1
        return out
    return _Pending(finish) if async_op else finish()


def _check_signed(scheme: str, what: str) -> None:
    if not get(scheme).signed:
        raise TierstoreValueError(f"scheme={scheme!r} represents no negative values; {what} with a signed scheme "
                                  f"such as 'int4' or 'int8'")


class _Pending:
    """A quantized collective in flight: wait() finishes it (once) and returns its output."""

    def __init__(self, finish):
        self._finish = finish
        self._out = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._out = self._finish()
            self._finish = None
        assert self._out is not None  # set by the first wait()
        return self._out


_SUBGROUPS: dict[tuple, tuple] = {}


def _subgroups(group, world: int, local: int):
    """(intra-node group of this rank, inter-node group of this rank), created once per (group, L).

    Every rank of ``group`` creates every subgroup, in the same order (torch.distributed requires it)."""
    key = (id(group) if group is not None else None, world, local)
    if key not in _SUBGROUPS:
        ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
        me = dist.get_rank(group)
        nodes = world // local
        intra = inter = None
        for k in range(nodes):
            g = dist.new_group([ranks[k * local + i] for i in range(local)])
            if me // local == k:
                intra = g
        for i in range(local):
            g = dist.new_group([ranks[k * local + i] for k in range(nodes)])
            if me % local == i:
                inter = g
        _SUBGROUPS[key] = (intra, inter)
    return _SUBGROUPS[key]


def _exchange(rows: torch.Tensor, me: int, group, scheme: str, block_size: int, acc: torch.Tensor) -> int:
    """rows: [P, M] fp32, row p destined to peer p of ``group``; fills acc [M] with the fp32 sum of what the
    P peers sent this rank (its own row added unquantized). Returns the bytes sent to others."""
    peers, m = rows.shape
    pn = payload_nbytes(scheme, m, block_size)
    send = torch.empty(peers * pn, dtype=torch.uint8)
    for p in range(peers):
        if p != me:
            _pack_into(rows[p], send[p * pn:(p + 1) * pn], scheme, block_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    acc.copy_(rows[me])
    tmp = torch.empty(m, dtype=torch.float32)
    for p in range(peers):  # fixed order: the fp32 sum is the same on every run
        if p != me:
            dequantize(Quantized.packed(recv[p * pn:(p + 1) * pn], scheme, m, block_size), out=tmp)
            acc += tmp
    return (peers - 1) * pn


def reduce_scatter_quantized(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                             intra_node_size: int | None = None, scheme: str = "int4",
                             block_size: int = DEFAULT_BLOCK, op: str = "avg",
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """qgZ: reduce ``tensor`` (same numel on every rank, divisible by world) over ``group`` and return this
    rank's shard (numel / world elements, fp32), via two quantized all-to-alls. See [Note: qgZ].

    intra_node_size: ranks per node L (default: all of them, one stage); world must be a multiple of it.
    scheme: 'int4' (ZeRO++), 'int8' or another signed scheme. op: 'avg' or 'sum'. Reductions are always in fp32."""
    _check_signed(scheme, "qgZ quantizes gradients")
    if op not in ("avg", "sum"):
        raise TierstoreValueError(f"op={op!r}: use 'avg' or 'sum'")
    check_block_size(block_size)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    local = world if intra_node_size is None else intra_node_size
    if local < 1 or world % local:
        raise TierstoreValueError(f"intra_node_size={intra_node_size} must divide the world size {world}")
    n = tensor.numel()
    if n % world:
        raise TierstoreValueError(f"tensor has {n} elements, not a multiple of the world size {world}; pad it")
    s = n // world  # elements per shard
    nodes = world // local
    if out is None:
        out = torch.empty(s, dtype=torch.float32)
    elif out.numel() != s or out.dtype != torch.float32 or not out.is_contiguous():
        raise TierstoreValueError(f"out must be a contiguous float32 tensor of {s} elements")
    x = tensor.detach().reshape(nodes, local, s).to(torch.float32)
    sent = 0
    if world == 1:
        out.copy_(x.reshape(-1))
    else:
        intra, inter = _subgroups(group, world, local) if 1 < local < world else (None, None)
        # stage 1: inside the node; row l = the K shards that local peer l aggregates
        if local > 1:
            rows = x.transpose(0, 1).reshape(local, nodes * s)
            partial = torch.empty(nodes * s, dtype=torch.float32)
            sent += _exchange(rows, me % local, intra if local < world else group, scheme, block_size, partial)
        else:
            partial = x.reshape(nodes * s)
        # stage 2: across nodes, among the ranks with this local index; row k = shard of rank k * L + me % L
        if nodes > 1:
            sent += _exchange(partial.view(nodes, s), me // local, inter if local > 1 else group, scheme,
                              block_size, out)
        else:
            out.copy_(partial)
    if op == "avg":
        out /= world
    t = _TRAFFIC["reduce_scatter_quantized"]
    t.bytes_sent += sent
    t.calls += 1
    return out
