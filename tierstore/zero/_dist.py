"""torch.distributed in the few shapes ZeRO-3 needs; every function is a no-op copy at world size 1."""
from __future__ import annotations

import torch
import torch.distributed as dist


def world_and_rank(group=None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def all_gather(shard: torch.Tensor, out: torch.Tensor, group=None, *, quantized: bool = False) -> torch.Tensor:
    """out (world x shard elements) = every rank's shard, in rank order (qwZ int8 when `quantized`)."""
    world, _ = world_and_rank(group)
    if world == 1:
        return out.copy_(shard)
    if quantized and shard.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from ..quant.collectives import all_gather_quantized
        return all_gather_quantized(shard, group, out=out)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard.contiguous(), group=group)
    return out


class Gathering:
    """An all-gather in flight (all_gather_async): wait() returns its output once every rank's part is in."""

    def __init__(self, out: torch.Tensor, work=None, finish=None, keep=()):
        self.out = out
        self._work = work
        self._finish = finish
        self._keep = keep  # the buffers the collective reads or writes, alive until it is waited

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep = ()
        return self.out


def all_gather_async(shard: torch.Tensor, out: torch.Tensor, group=None, *, quantized: bool = False) -> Gathering:
    """all_gather posted with async_op=True: the collective is issued now (so its place in the sequence of
    collectives is now, on every rank), the caller waits later. Bit-identical to all_gather.

    qwZ: this rank's shard is quantized now, the int8 payloads travel asynchronously and are dequantized in
    wait() (quant.collectives.all_gather_quantized with async_op=True)."""
    world, _ = world_and_rank(group)
    if world == 1:
        return Gathering(out.copy_(shard))
    if quantized and shard.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from ..quant.collectives import all_gather_quantized
        return Gathering(out, all_gather_quantized(shard, group, out=out, async_op=True))  # its wait() dequantizes
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    shard = shard.contiguous()
    work = fn(out, shard, group=group, async_op=True)
    return Gathering(out, work, keep=(shard,))


def reduce_scatter_avg(full: torch.Tensor, group=None, *, quantized: bool = False,
                       intra_node_size: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard (fp32) of the mean over ranks of `full` (fp32, numel divisible by world), written
    into `out` when given (fp32, contiguous, numel / world elements; not with `quantized`)."""
    world, _ = world_and_rank(group)
    if world == 1:
        return full.to(torch.float32, copy=True) if out is None else out.copy_(full)
    if quantized:
        if out is not None:
            raise ValueError("reduce_scatter_avg(quantized=True) makes its own output; out= is not supported")
        from ..quant.collectives import reduce_scatter_quantized
        return reduce_scatter_quantized(full, group, intra_node_size=intra_node_size, scheme="int4", op="avg")
    if out is None:
        out = torch.empty(full.numel() // world, dtype=torch.float32, device=full.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full.to(torch.float32).contiguous(), group=group)
    return out.div_(world)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    """In place. The small CPU tensors of flags and statistics go to the accelerator when the group's backend
    has no CPU side (NCCL alone: "No backend type associated with device type cpu"). That branch only runs
    with an accelerator, never on the CPU-only development machine."""
    backend = str(dist.get_backend(group))
    if x.device.type == "cpu" and "gloo" not in backend and "mpi" not in backend and "cpu" not in backend:
        acc = torch.accelerator.current_accelerator()
        assert acc is not None  # a backend with no CPU side (NCCL) runs on one
        y = x.to(torch.device(acc.type, torch.accelerator.current_device_index()))
        dist.all_reduce(y, op=op, group=group)
        return x.copy_(y)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    world, _ = world_and_rank(group)
    return _all_reduce(x, dist.ReduceOp.SUM, group) if world > 1 else x


def all_reduce_max(x: torch.Tensor, group=None) -> torch.Tensor:
    world, _ = world_and_rank(group)
    return _all_reduce(x, dist.ReduceOp.MAX, group) if world > 1 else x


class Reducing:
    """An all_reduce in flight (all_reduce_max_async): ``wait()`` returns its result (in place in the tensor
    given). ``ready()``: whether waiting now costs no device synchronisation -- always with a backend that
    reduces host tensors (gloo), where a wait costs at most the other ranks' arrival; on a device-only
    backend (NCCL) only once the collective has completed."""

    def __init__(self, x: torch.Tensor, work=None, device_copy: torch.Tensor | None = None):
        self.x = x
        self._work = work
        self._device_copy = device_copy

    def ready(self) -> bool:
        if self._work is None or self._device_copy is None:
            return True
        return bool(self._work.is_completed())  # accelerator only -- never run here

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._device_copy is not None:  # accelerator only -- never run here
                self.x.copy_(self._device_copy)
                self._device_copy = None
        return self.x


def all_reduce_max_async(x: torch.Tensor, group=None) -> Reducing:
    """all_reduce_max posted with async_op=True: its place in the sequence of collectives is now, on every rank;
    the caller waits later (see Reducing)."""
    world, _ = world_and_rank(group)
    if world == 1:
        return Reducing(x)
    backend = str(dist.get_backend(group))
    if x.device.type == "cpu" and "gloo" not in backend and "mpi" not in backend and "cpu" not in backend:
        acc = torch.accelerator.current_accelerator()  # as in _all_reduce; never run here
        assert acc is not None
        y = x.to(torch.device(acc.type, torch.accelerator.current_device_index()))
        return Reducing(x, dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group, async_op=True), y)
    return Reducing(x, dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group, async_op=True))


def barrier(group=None) -> None:
    world, _ = world_and_rank(group)
    if world > 1:
        dist.barrier(group=group)


def all_gather_object(obj, group=None) -> list:
    world, _ = world_and_rank(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    world, _ = world_and_rank(group)
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
