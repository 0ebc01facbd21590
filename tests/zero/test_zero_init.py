"""zero.Init (peak memory while building is about one layer), TiledLinear (== nn.Linear, one tile gathered
at a time) and traced prefetch (records, prefetches, rebuilds on an order change without hanging)."""
from __future__ import annotations

import copy
import logging
import pathlib

import pytest
import torch
import torch.nn as nn

from tests.support import (
    Branchy,
    Deep,
    Net,
    batches,
    cfg,
    loss_fn,
    max_rel,
    peak_growth,
    rss_follows_live_memory,
    run_isolated,
)
from tierstore.errors import MisuseError, TierstoreValueError
from tierstore.zero import Init, TiledLinear, Zero3Optimizer
from tierstore.zero.params.init import OffloadedParameter


def _measure_build(root: str) -> dict:
    """In a fresh process: peak RSS growth while building Deep() plainly and under zero.Init (nvme)."""
    rss_follows_live_memory()
    c = cfg(pathlib.Path(root), params="nvme", states="host", grads="host", pinned_bytes=4 << 20)
    plain, _ = peak_growth(lambda: Deep())
    with Init(c) as init:
        # Warm up first: the first layer offloaded starts the engine's threads, loads native libraries and
        # imports what the store needs on first use. That one-time cost varied with the process (7-17 MiB
        # seen), and it is not what this test measures: memory per layer built.
        Deep(layers=1)
        grown, model = peak_growth(lambda: Deep())
        # offloaded: the value is in the store and .data is empty (the metadata reads as the real parameter's)
        with torch._C.DisableTorchFunctionSubclass():  # the tensor itself, not what its metadata reads as
            empty = all(p.data.numel() == 0 for p in model.parameters())
        ok = init.offloaded == 26 and empty and all(isinstance(p, OffloadedParameter) and p.numel() == 1024 * (
            1024 if p.dim() == 2 else 1) for p in model.parameters())
    return {"plain": plain, "grown": grown, "ok": ok}


def test_init_peak_memory_is_about_one_layer(tmp_path):
    r = run_isolated(_measure_build, str(tmp_path), timeout=120)
    layer = 1024 * 1024 * 4  # bytes of one layer's weight
    print(f"building 12 x 4 MiB layers: peak RSS +{r['plain'] / 2**20:.1f} MiB plain, +{r['grown'] / 2**20:.1f} "
          f"MiB under zero.Init (one layer = {layer / 2**20:.0f} MiB)")
    assert r["ok"]
    assert r["plain"] >= 10 * layer  # the measurement sees the model when it is in memory
    assert r["grown"] <= 2.5 * layer, r["grown"]  # about one layer (plus staging), not twelve


def test_init_then_optimizer_equals_plain_build(tmp_path):
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    with Init(cfg(tmp_path / "i", params="nvme")) as init:
        m = Net()
    assert init.offloaded == len(list(ref.parameters()))
    assert m.fc1.weight._tierstore_init.shape == (32, 16)  # the handle init.py documents for users
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "o", params="nvme"))
    assert init.store is None  # every value was taken and the init store closed
    full = opt.full_state_dict()
    assert all(torch.equal(full[n], p) for n, p in ref.state_dict().items())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches(5):
        for mm, o in ((ref, ropt), (m, opt)):
            loss_fn(mm, x, y).backward()
            o.step()
            o.zero_grad()
    assert max_rel(opt.full_state_dict(), ref) <= 1e-6
    opt.close()
    assert "__init__" not in nn.Linear.__dict__ or not hasattr(nn.Linear.__init__, "__wrapped__")  # unpatched


def test_init_large_parameter_in_chunks_taken_bucket_by_bucket(tmp_path):
    """A 1.4 MB weight is stored in 2 chunks (1 MiB each at most) and lies in several 256 KiB buckets: the
    optimizer takes it range by range, deleting each chunk once all of its elements were taken."""
    c = cfg(tmp_path / "i", params="nvme", sub_group_bytes=256 << 10, min_io_bytes=64 << 10)
    torch.manual_seed(0)
    ref = nn.Linear(600, 600)
    torch.manual_seed(0)
    with Init(c) as init:
        m = nn.Linear(600, 600)
    assert len(m.weight._tierstore_init.keys) == 2 and init.stored_chunks == 3
    deleted = []  # chunks in the Init store at each delete the optimizer's construction makes
    store, delete = init.store, init.store.delete
    store.delete = lambda key: (deleted.append((key, len(store.keys()))), delete(key))
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path / "o", params="host",
                                                                sub_group_bytes=256 << 10, min_io_bytes=64 << 10))
    assert len(opt.layout.param_gids["weight"]) >= 5  # split over buckets
    assert [n for _k, n in deleted] == [3, 2, 1] and init.store is None  # one chunk at a time, then closed
    full = opt.full_state_dict()
    assert torch.equal(full["weight"], ref.weight) and torch.equal(full["bias"], ref.bias)
    opt.close()


def test_module_built_under_init_but_not_optimized_fails_clearly(tmp_path):
    c = cfg(tmp_path / "i", params="host")
    with Init(c):
        m = Net()
        stray = nn.Linear(3, 3)
    x = torch.randn(2, 16)
    with pytest.raises(MisuseError, match=r"Linear was built under tierstore.zero.Init .*not taken by a Zero3Opt"):
        m(x)  # before the optimizer took the parameters
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path / "o"))

    def guards(mod):  # torch's table of forward pre-hooks: whether the guards removed themselves
        return [h for h in mod._forward_pre_hooks.values() if "_guard_unclaimed" in h.__qualname__]
    assert guards(m.fc1) and guards(stray)
    m(x)  # now taken: the guards of m's modules removed themselves
    assert not any(guards(mod) for mod in m.modules()) and guards(stray)
    with pytest.raises(MisuseError, match=r"Linear .*\['weight', 'bias'\] were not taken.*whole value"):
        stray(torch.randn(2, 3))
    opt.close()


def test_weight_replaced_by_tying_is_freed_from_the_init_store(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)  # its own weight is offloaded when Linear's __init__ returns
            self.head.weight = self.embed.weight  # ... and dropped here: its chunk must go with it

        def forward(self, idx):
            return self.head(self.embed(idx))
    c = cfg(tmp_path, params="nvme")
    init = Init(c)
    with init:
        m = Tied()
    assert init.stored_chunks == 1  # the embedding's chunk only
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=c)
    assert init.stored_chunks == 0 and init.store is None  # everything taken: the Init store is closed
    # ... and its files are gone: left behind, they held the parameters' size in disk space for the whole run
    nvme = pathlib.Path(c.nvme_paths[0])
    assert sorted(p.name for p in nvme.iterdir()) == ["rank0"]  # no init-rank0
    m(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    opt.close()


def test_tiled_linear_equals_linear_and_gathers_one_tile_at_a_time(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    tiled = TiledLinear.from_linear(lin, in_splits=3, out_splits=4)
    x = torch.randn(5, 96, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), tiled(x2)
    assert torch.allclose(y, y2, rtol=1e-6, atol=1e-6)
    y.square().sum().backward()
    y2.square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(lin.weight.grad[:20, 32:64], tiled.tiles[0][1].weight.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(TierstoreValueError, match="in_splits"):
        TiledLinear(4, 4, in_splits=5)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tl = TiledLinear(96, 80, in_splits=3, out_splits=4)

        def forward(self, x):
            return self.tl(x)

    torch.manual_seed(1)
    m = Model()
    ref = copy.deepcopy(m)
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, params="host", min_io_bytes=0,
                                                                 sub_group_bytes=1 << 20))
    live = []
    orig = opt.coordinator.gather

    def spy(gids):
        orig(gids)
        st = opt.coordinator.stats()
        tiles = sum(1 for g in st.buckets_held if opt.layout.bucket(g).payload_numel >= 640)  # weight tiles
        live.append(("forward" if st.in_forward else "backward", tiles))
    opt.coordinator.gather = spy
    x = torch.randn(4, 96)
    m(x).square().mean().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).square().mean().backward()
    ref_opt.step()
    fwd = [n for phase, n in live if phase == "forward"]
    bwd = [n for phase, n in live if phase == "backward"]
    assert len(opt.layout.subgroups) == 16 and len(fwd) == 12 and len(bwd) == 12
    assert max(fwd) == 1  # forward: one weight tile at a time (min_io_bytes=0: every parameter its own bucket)
    assert max(bwd) <= 2  # backward: a tile is released when its gradient lands, after the next one's gather
    assert max_rel(opt.full_state_dict(), ref) <= 1e-6
    opt.close()


def test_traced_prefetch_hits_and_rebuilds_on_order_change(tmp_path, caplog):
    torch.manual_seed(0)
    m = Branchy()
    ref = copy.deepcopy(m)
    # the unused branch gets no gradient and is skipped by the step, as in torch
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, params="nvme", prefetch_depth=2,
                                                                min_io_bytes=0))
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    co = opt.coordinator
    data = batches(8)
    with caplog.at_level(logging.DEBUG, logger="tierstore.zero"):
        for i, (x, y) in enumerate(data):
            for mm in (m, ref):
                mm.use_b = i in (4, 5)  # the order changes at step 4 and back at step 6
            for mm, o in ((ref, ropt), (m, opt)):
                loss_fn(mm, x, y).backward()
                o.step()
                o.zero_grad()
            if i == 3:
                st = co.stats()
                assert co.trace.order and not co.trace.recording and st.prefetch_hits - st.prefetch_hits_backward > 0
                assert st.prefetch_hits_backward > 0  # backward walks the trace in reverse
                assert st.trace_rebuilds == 0
    st = co.stats()
    assert st.trace_rebuilds >= 2
    assert any("order changed" in r.getMessage() for r in caplog.records)
    # nothing else left in flight than the next forward's first reads, started by the last step ([Note:
    # prefetch after the step]; world 1: no all-gathers)
    assert st.reads_in_flight > 0 and st.gathers_in_flight == 0
    assert st.staged >= st.prefetch_hits > 0  # every shard read ahead went through the host->device stage
    assert st.staged_copies == 0 and st.gathers_ahead == 0  # CPU: the stage hands shards through; world 1: none
    assert max_rel(opt.full_state_dict(), ref) <= 1e-6  # parity with prefetching and order changes
    opt.close()
