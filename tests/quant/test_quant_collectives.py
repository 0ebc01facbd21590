"""qwZ / qgZ with gloo at world 2 and world 4 (2 "nodes" x 2): error within the documented bound of the
fp32 collective, and the bytes actually sent against an fp16 collective."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support import run_ranks


def rank_measures(rank: int, world: int, local: int) -> dict:
    """On every rank of a gloo group (support.run_ranks): the quantized collectives' errors and bytes sent."""
    from tierstore.quant import collectives as C
    from tierstore.quant import quantize

    out = {}
    # qwZ: every rank's shard, gathered int8
    g = torch.Generator().manual_seed(100 + rank)
    shard = torch.randn(10_000, generator=g) * torch.exp(torch.randn(10_000, generator=g))
    C.reset_traffic()
    got = C.all_gather_quantized(shard, block_size=256)
    ref = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(ref, shard)
    err_ok = True
    for r in range(world):
        q = quantize(ref[r], "int8", 256)
        bound = q.absmax.repeat_interleave(256)[:shard.numel()] / 254 * (1 + 1e-5)
        err_ok &= bool(((got[r * 10_000:(r + 1) * 10_000] - ref[r]).abs() <= bound).all())
    out["qwz_ok"] = err_ok
    out["qwz_ratio"] = C.traffic()["all_gather_quantized"].bytes_sent / C.fp16_all_gather_bytes(10_000, world)
    # qgZ: int4 and int8, avg, hierarchical with intra_node_size=local
    n = 64 * 1024 * world
    g = torch.Generator().manual_seed(200 + rank)
    grad = torch.randn(n, generator=g)
    full = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(full, grad)
    exact = torch.stack(full).sum(0).view(world, -1)[rank] / world
    amax = max(float(t.abs().max()) for t in full)
    for scheme, e in (("int4", 1 / 14), ("int8", 1 / 254)):
        C.reset_traffic()
        y = C.reduce_scatter_quantized(grad, intra_node_size=local, scheme=scheme, block_size=256)
        nodes = world // local
        # each quantized term carries <= e x (absmax of its block); node partial sums are <= local x amax
        bound = e * amax * ((local - 1) + (nodes - 1) * local * (1 + e)) / world
        out[f"qgz_{scheme}_maxerr"] = float((y - exact).abs().max())
        out[f"qgz_{scheme}_bound"] = bound
        out[f"qgz_{scheme}_rel"] = float((y - exact).norm() / exact.norm())
        out[f"qgz_{scheme}_ratio"] = (C.traffic()["reduce_scatter_quantized"].bytes_sent
                                      / C.fp16_reduce_scatter_bytes(n, world))
    ysum = C.reduce_scatter_quantized(grad, intra_node_size=local, scheme="int8", op="sum")
    out["sum_vs_avg"] = float((ysum / world - C.reduce_scatter_quantized(grad, intra_node_size=local,
                                                                         scheme="int8")).abs().max())
    return out


@pytest.mark.parametrize("world,local", [(2, 2), (4, 2)], ids=["world2", "world4-2x2"])
def test_quantized_collectives_gloo(world, local):
    res = run_ranks(rank_measures, world, local, timeout=120)
    r0 = res[0]
    print(f"\nworld {world} ({world // local} nodes x {local}): qwZ bytes {r0['qwz_ratio']:.3f}x fp16 all-gather; "
          f"qgZ int4 {r0['qgz_int4_ratio']:.3f}x fp16 reduce-scatter, rel err {r0['qgz_int4_rel']:.4f}; "
          f"int8 {r0['qgz_int8_ratio']:.3f}x, rel err {r0['qgz_int8_rel']:.5f}")
    for r in res:
        assert r["qwz_ok"]
        assert r["qwz_ratio"] <= 0.53
        assert r["qgz_int4_ratio"] <= 0.30
        for s in ("int4", "int8"):
            assert r[f"qgz_{s}_maxerr"] <= r[f"qgz_{s}_bound"], (s, r)
        assert r["qgz_int8_rel"] < r["qgz_int4_rel"] < 0.2
        assert r["sum_vs_avg"] < 1e-5
