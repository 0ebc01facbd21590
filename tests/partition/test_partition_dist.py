"""tierstore.partition across real processes: gloo, 2 and 4 ranks on this machine.

Each rank keeps only its shards; all_gather of the shards must rebuild every parameter exactly (compared with
a seeded reference), and a rank resuming from shards saved under another world size must read only what it
needs and end up with the same shards.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support import run_ranks
from tierstore.partition import Plan, plan, reshard_copies, reshard_shards

OPTIONS = dict(min_io_bytes=4096, alignment=512, bucket_bytes=64 << 10)  # bytes: small, so the model splits


def model_specs() -> dict:
    """A small transformer-like model: mixed dtypes, scalars, an empty tensor, a parameter split over buckets."""
    specs = {"embed": ((1000, 48), torch.bfloat16), "scale": ((), torch.float32), "unused": ((0, 8), torch.float16)}
    for i in range(3):
        specs[f"layers.{i}.norm"] = ((48,), torch.float32)
        specs[f"layers.{i}.qkv"] = ((48, 144), torch.bfloat16)
        specs[f"layers.{i}.qkv_bias"] = ((144,), torch.float16)
        specs[f"layers.{i}.mlp"] = ((48, 192), torch.bfloat16)
        specs[f"layers.{i}.mask"] = ((7, 3), torch.bool)
        specs[f"layers.{i}.codes"] = ((300,), torch.int8)
    specs["head"] = ((48, 1000), torch.float32)
    return specs


def reference(specs: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, (shape, dtype) in specs.items():
        if dtype == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=g).bool()
        elif dtype == torch.int8:
            out[name] = torch.randint(-128, 128, shape, generator=g).to(dtype)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def all_gather_bucket(shard: torch.Tensor, world: int) -> torch.Tensor:
    """The whole bucket from every rank's shard (as bytes: gloo need not know bool or bfloat16)."""
    raw = shard.view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(parts, raw)
    return torch.cat(parts).view(shard.dtype)


def rank_checks(rank: int, world: int, ckpt: str) -> None:
    """Run on every rank of a gloo group (support.run_ranks); an assertion here fails the test with its
    traceback."""
    specs = model_specs()
    pl = plan(specs, world, **OPTIONS)
    assert pl.split_params, "the model is meant to exercise split parameters"
    every = [None] * world
    dist.all_gather_object(every, pl.to_dict())
    assert all(d == every[0] for d in every), "every rank plans the same layout"

    # Each rank keeps only its shards (built without ever materialising a whole bucket).
    mine = {b.index: pl.flatten_shard(reference(specs), b, rank) for b in pl.buckets}
    assert sum(t.numel() * t.element_size() for t in mine.values()) == pl.rank_bytes
    assert all(t.numel() == pl.buckets[i].shard_numel for i, t in mine.items())

    rebuilt = pl.unflatten([all_gather_bucket(mine[b.index], world) for b in pl.buckets])
    want = reference(specs)
    for name, t in want.items():
        assert rebuilt[name].shape == t.shape and rebuilt[name].dtype == t.dtype, name
        assert torch.equal(rebuilt[name], t), f"rank {rank}: {name} differs after all_gather"

    # Resume from a checkpoint written under another world size: rank 0 writes it (one file per
    # shard, as a store would), every rank then reads only the files its new shards need.
    saved_world = 6 - world  # 2 <-> 4
    src = pl.reshard(saved_world)
    if rank == 0:
        full = reference(specs)
        for b in src.buckets:
            for r in range(saved_world):
                torch.save(src.flatten_shard(full, b, r).clone(), Path(ckpt, f"{b.index}-{r}.pt"))
        Path(ckpt, "plan.json").write_text(json.dumps(src.to_dict()))
    dist.barrier()
    src = Plan.from_dict(json.loads(Path(ckpt, "plan.json").read_text()))
    opened = []

    def load(bucket: int, r: int) -> torch.Tensor:
        opened.append((bucket, r))
        return torch.load(Path(ckpt, f"{bucket}-{r}.pt"))

    resumed = reshard_shards(src, pl, load, dst_ranks=[rank])
    assert len(opened) == len(set(opened)), "each saved shard is read at most once"
    needed = {(c.src_bucket, c.src_rank) for c in reshard_copies(src, pl, dst_ranks=[rank])}
    assert set(opened) == needed and len(needed) < len(src.buckets) * saved_world
    for i, t in mine.items():
        assert torch.equal(resumed[i, rank], t), f"rank {rank}: bucket {i} differs after resharding"
    again = pl.unflatten([all_gather_bucket(resumed[b.index, rank], world) for b in pl.buckets])
    assert all(torch.equal(again[n], t) for n, t in want.items())
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_of_shards_rebuilds_every_parameter(world, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_ranks(rank_checks, world, str(ckpt), timeout=60)
