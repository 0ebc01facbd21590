"""[Note: split master] in tierstore/zero/step/split_master.py: with bfloat16 compute and the parameters on the
states' tier the fp32 master is stored as the bfloat16 parameter plus an int16 remainder. The encoding is exact
but for ties (moved one fp32 ulp towards hi, still rounding to it); training, the disk bytes by kind, the
masters at hand, checkpoints both ways and the model's state dict."""
from __future__ import annotations

import pathlib

import pytest
import torch

from tests.support import Deep, Net, batches, cfg, loss_fn, run_ranks
from tierstore.errors import TierstoreValueError
from tierstore.zero import Zero3Optimizer, keys, release_model
from tierstore.zero.step.split_master import CHUNK, applies, join, joined, split

pytestmark = pytest.mark.usefixtures("one_torch_thread")

I32 = torch.int32


def _bits(*patterns: int) -> torch.Tensor:
    """fp32 values of the given 32-bit patterns."""
    return torch.tensor([p - (1 << 32) if p >= 1 << 31 else p for p in patterns], dtype=I32).view(torch.float32)


def _ties(x: torch.Tensor) -> torch.Tensor:
    return (x.view(I32) & 0xFFFF) == 0x8000


def _check_round_trip(x: torch.Tensor) -> None:
    hi, lo = split(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))  # hi is torch's RNE
    y = join(hi, lo)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(y), nan)  # NaN stays NaN, nothing else becomes one
    tie, keep = _ties(x) & ~nan, ~_ties(x) & ~nan
    assert torch.equal(y[keep].view(I32), x[keep].view(I32))  # bit for bit
    # a tie moves one fp32 ulp towards hi and still rounds to the same hi
    step = y[tie].view(I32).long() - x[tie].view(I32).long()
    towards = (hi[tie].float().view(I32).long() - x[tie].view(I32).long()).sign()
    assert torch.equal(step, towards) and bool((step.abs() == 1).all())
    assert torch.equal(y[tie].to(torch.bfloat16).view(torch.int16), hi[tie].view(torch.int16))
    assert not bool(_ties(y[~nan]).any())  # a joined master is never a tie


def test_every_remainder_of_chosen_high_halves_round_trips_but_ties():
    # each high half with all 65536 low halves (crossing the chunk boundary): zero, the smallest subnormals,
    # odd and even bf16 values, the largest finite (whose upper half rounds to inf), negatives, inf / NaN
    highs = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80, 0x7FC0,
             0x8000, 0x8001, 0xBF80, 0xBF81, 0xFF7F, 0xFF80, 0xFFC0]
    low = torch.arange(1 << 16, dtype=torch.int64)
    x = torch.cat([((h << 16) + low) for h in highs])
    x = torch.where(x >= 1 << 31, x - (1 << 32), x).to(I32).view(torch.float32)
    assert x.numel() > CHUNK
    _check_round_trip(x)
    assert int((_ties(x) & ~torch.isnan(x)).sum()) == 13  # the inf / NaN high halves hold NaN at 0x8000
    hi, _lo = split(x)
    assert bool(torch.isinf(hi[x.view(I32) == 0x7F7FFFFF].float()).all())  # max float's hi is inf, joined back


def test_random_and_edge_values_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * CHUNK + 5, generator=g) * torch.exp2(torch.randint(-140, 120, (3 * CHUNK + 5,),
                                                                           generator=g).float())
    edges = _bits(0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                  0x7F800000, 0xFF800000, 0x7F7F8000, 0x7F7F7FFF, 0x7FC00000, 0xFFC00001, 0x7F800001,
                  0x3F808000, 0x3F818000)
    _check_round_trip(torch.cat([x, edges]))
    hi, lo = split(edges)
    assert hi[9].item() == float("inf")  # 0x7F7F8000: a tie whose even neighbour is inf
    assert join(hi, lo).view(I32)[9].item() == 0x7F7F8001  # one ulp towards it: finite, rounding to inf


def test_split_writes_into_given_buffers_and_leaves_the_master():
    x = torch.randn(CHUNK + 3)
    before = x.clone()
    hi, lo = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
    h2, l2 = split(x, hi, lo)
    assert h2.data_ptr() == hi.data_ptr() and l2.data_ptr() == lo.data_ptr() and torch.equal(x, before)
    out = torch.empty_like(x)
    assert join(hi, lo, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out[~_ties(x)], x[~_ties(x)])


def test_a_master_joined_where_the_buffers_are_not_stays_out_of_them():
    """States resident on a memory tier of another device than the model's (whose buffers the step's pool
    holds): the master is joined on the halves' device and never given back to that pool."""
    class Loaded:
        def __init__(self):
            x = torch.randn(100)
            hi, lo = split(x)
            self.tensors, self.resident = {"hi": hi, "lo": lo}, {"hi", "lo"}

    class Pool:
        device = torch.device("meta")

        def take(self, numel, dtype):
            raise AssertionError("a buffer of another device")

    t = Loaded()
    master = joined(t, Pool())
    assert master.device.type == "cpu" and "master" in t.resident and joined(t, Pool()) is master


# -- training ---------------------------------------------------------------------------------------------
def _make_ties(model: torch.nn.Module, every: int = 7) -> int:
    """Make every `every`-th weight element a tie (low 16 bits 0x8000); returns how many."""
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            b = p.view(-1).view(I32)
            b[::every] = (b[::every] & ~0xFFFF) | 0x8000
            n += b[::every].numel()
    return n


def _masters(opt) -> torch.Tensor:
    return torch.cat([opt.export_subgroup(g)["master"].reshape(-1) for g in opt.layout.trainable_gids()])


def _params(opt) -> torch.Tensor:
    return torch.cat([opt.store.get(keys.param(g)).reshape(-1) for g in opt.layout.trainable_gids()])


def _build(path, split_master, **kw):
    torch.manual_seed(0)
    m = Net()
    ties = _make_ties(m)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, config=cfg(
        path, "nvme", "nvme", "nvme", compute_dtype=torch.bfloat16, split_master=split_master, **kw))
    return m, opt, ties


@pytest.mark.parametrize("overlap", [False, True])
def test_training_with_the_split_matches_fp32_masters_but_for_ties(tmp_path, overlap):
    runs = {}
    for split_master in (False, True):
        m, opt, ties = _build(tmp_path / str(split_master), split_master, overlap_step=overlap)
        try:
            assert opt.store.get(keys.master(0)).dtype == (torch.int16 if split_master else torch.float32)
            first = (_params(opt), _masters(opt))
            history = []
            for x, y in batches(4):
                loss_fn(m, x.bfloat16(), y.bfloat16()).backward()
                opt.step()
                opt.zero_grad()
                history.append(_params(opt))
            st, gids = opt.stats(), len(opt.layout.trainable_gids())
            runs[split_master] = first, history, _masters(opt), st
        finally:
            opt.close()
    (p0a, m0a), hist_a, ma, sta = runs[False]
    (p0b, m0b), hist_b, mb, stb = runs[True]
    tie = _ties(m0a)
    assert int(tie.sum()) == ties > 0  # the fp32 masters keep the ties; the split moved each one ulp
    assert torch.equal(m0a[~tie], m0b[~tie]) and bool(((m0a[tie].view(I32) - m0b[tie].view(I32)).abs() == 1).all())
    assert torch.equal(p0a.view(torch.int16), p0b.view(torch.int16))
    for a, b in zip(hist_a, hist_b):  # the compute copies: bit for bit, every step
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(hist_b[-1], p0b)  # the steps moved the parameters
    # the masters: equal but where a tie was moved, by what that one ulp became over the steps (a few ulps of
    # the starting value: measured 3)
    differ = ma.view(I32) != mb.view(I32)
    assert bool(differ.any()) and bool((differ & ~tie).sum() <= 2)
    assert float(((ma - mb).abs() / m0a.abs().clamp_min(1e-30))[differ].max()) < 2.0 ** -20
    assert "split-master" not in sta.step_paths and stb.step_paths["split-master"] == 4 * gids
    if overlap:  # backward's bfloat16 buckets were the halves at hand
        assert stb.masters_at_hand > 0 and stb.step_paths.get("masters-at-hand", 0) == stb.masters_at_hand


def _ranks_train(rank, world, root):
    """Three steps of Net on this rank's share of the batch, host tiers, bf16: the parameter shards after each
    step, with and without the split."""
    out = {}
    for split_master in (False, True):
        torch.manual_seed(0)
        m = Net()
        _make_ties(m)
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(
            pathlib.Path(root) / f"{rank}-{split_master}", "host", "host", "host", compute_dtype=torch.bfloat16,
            split_master=split_master))
        out[split_master] = [opt.store.get(keys.master(opt.layout.trainable_gids()[0])).dtype]
        for x, y in batches(3):
            loss_fn(m, x.chunk(world)[rank].bfloat16(), y.chunk(world)[rank].bfloat16()).backward()
            opt.step()
            opt.zero_grad()
            out[split_master].append(_params(opt))
        opt.close()
    return out


def test_training_at_world_size_2_with_the_split_keeps_the_compute_copies(tmp_path):
    results = run_ranks(_ranks_train, 2, str(tmp_path))
    assert any(not torch.equal(res[True][1], res[True][-1]) for res in results)  # (a rank may hold only padding)
    for res in results:
        assert res[False][0] == torch.float32 and res[True][0] == torch.int16
        for a, b in zip(res[False][1:], res[True][1:]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# -- disk bytes by kind ([Note: disk bytes by kind]) ------------------------------------------------------------
def _one_step_bytes(path, **kw):
    """(read, written by kind in the second step, masters at hand in it, trainable shard elements) of Deep(2, 64)
    with everything on nvme in bfloat16."""
    torch.manual_seed(0)
    m = Deep(layers=2, width=64)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
        path, "nvme", "nvme", "nvme", compute_dtype=torch.bfloat16, prefetch_depth=0, **kw))
    try:
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        for _ in range(2):
            before, nv0 = opt.stats(), opt.store.stats()["nvme"]
            m(x).float().sum().backward()
            opt.step()
            opt.zero_grad()
        after, nv1 = opt.stats(), opt.store.stats()["nvme"]
        read = {k: after.disk_read[k] - before.disk_read[k] for k in after.disk_read}
        written = {k: after.disk_written[k] - before.disk_written[k] for k in after.disk_written}
        assert sum(read.values()) == nv1["bytes_out"] - nv0["bytes_out"]  # every byte counted under a kind
        assert sum(written.values()) == nv1["bytes_in"] - nv0["bytes_in"]
        n = sum(opt.layout.shard_numel(g) for g in opt.layout.trainable_gids())
        return read, written, after.masters_at_hand - before.masters_at_hand, n, len(opt.layout.trainable_gids())
    finally:
        opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_master_costs_two_bytes_and_backward_hands_the_step_its_upper_half(tmp_path, overlap):
    kw = dict(overlap_step=overlap, sub_group_bytes=64 * 64 * 2 + 512)
    r_off, w_off, _, n, gids = _one_step_bytes(tmp_path / "a", split_master=False, **kw)
    r_on, w_on, at_hand, _, _ = _one_step_bytes(tmp_path / "b", **kw)
    assert w_off["master"] == r_off["master"] == 4 * n
    assert w_on["master"] == r_on["master"] == 2 * n  # the remainder: the fp32 master would fail this
    assert w_on["params"] == w_off["params"] == 2 * n and w_on["states"] == w_off["states"] >= 8 * n
    if overlap:  # every bucket backward released was at hand (the budget covers the stream's queue too):
        assert r_on["params"] == r_off["params"] and at_hand == gids  # the step read no parameter shard
    else:  # after backward, as many as reuse_bytes held (here 2 of 3): the others' shards read again
        assert 0 < at_hand < gids and r_off["params"] < r_on["params"] < r_off["params"] + 2 * n
    _r, _w, none_at_hand, _, _ = _one_step_bytes(tmp_path / "c", reuse_bytes=0, **kw)
    r_ref, _w, _, _, _ = _one_step_bytes(tmp_path / "d", reuse_bytes=0, split_master=False, **kw)
    assert none_at_hand == 0 and _r["params"] == r_ref["params"] + 2 * n and _r["master"] == 2 * n
    if overlap:
        assert w_on["grads"] == 0 and sum(w_on.values()) == 12 * n + (w_on["states"] - 8 * n)


# -- checkpoints and the model's state dict --------------------------------------------------------------
def test_checkpoints_load_across_the_split_both_ways(tmp_path):
    m, opt, _ = _build(tmp_path / "a", True)
    try:
        for x, y in batches(2):
            loss_fn(m, x.bfloat16(), y.bfloat16()).backward()
            opt.step()
            opt.zero_grad()
        opt.save_checkpoint(tmp_path / "ck1")
        want, want_masters = opt.full_state_dict(), _masters(opt)
        want_states = [opt.export_subgroup(g)["state"] for g in opt.layout.trainable_gids()]
    finally:
        opt.close()
    for i, split_master in enumerate((False, True)):  # with the split -> fp32 masters -> with the split again
        _m, opt, _ = _build(tmp_path / f"b{i}", split_master)
        try:
            opt.load_checkpoint(tmp_path / f"ck{i + 1}")
            full = opt.full_state_dict()
            assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want)
            assert torch.equal(_masters(opt).view(I32), want_masters.view(I32))
            for g, st in zip(opt.layout.trainable_gids(), want_states):
                got = opt.export_subgroup(g)["state"]
                assert all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(v)) for k, v in st.items())
            opt.save_checkpoint(tmp_path / f"ck{i + 2}")
        finally:
            opt.close()


def test_an_fp32_checkpoint_with_ties_loads_into_the_split_moving_them_one_ulp(tmp_path):
    _m, opt, _ = _build(tmp_path / "a", False)
    try:
        opt.save_checkpoint(tmp_path / "ck")
        want = _masters(opt)
    finally:
        opt.close()
    _m, opt, _ = _build(tmp_path / "b", True)
    try:
        opt.load_checkpoint(tmp_path / "ck")
        got, tie = _masters(opt), _ties(want)
        assert bool(tie.any()) and torch.equal(got[~tie], want[~tie])
        assert bool(((got[tie].view(I32) - want[tie].view(I32)).abs() == 1).all())
    finally:
        opt.close()


def test_model_state_dict_and_load_state_dict_with_the_split(tmp_path):
    new = None
    for i in range(2):
        m, opt, _ = _build(tmp_path / str(i), True)
        sd = m.state_dict()
        assert all(v.dtype == torch.bfloat16 and v.numel() > 0 for v in sd.values())
        new = new or {k: torch.randn(v.shape) for k, v in sd.items()}  # fp32 values: the masters take them
        m.load_state_dict(new)
        if i:  # the masters, as release_model leaves them: the values loaded, bit for bit but ties
            model = release_model(opt)
            for k, v in model.state_dict().items():
                assert v.dtype == torch.float32 and torch.equal(v[~_ties(new[k])], new[k][~_ties(new[k])]), k
            break
        try:
            assert all(torch.equal(m.state_dict()[k], v.bfloat16()) for k, v in new.items())
            loss_fn(m, *(t.bfloat16() for t in batches(1)[0])).backward()
            opt.step()
            assert not torch.equal(m.state_dict()["fc1.weight"], new["fc1.weight"].bfloat16())
        finally:
            opt.close()


@pytest.mark.parametrize("tier, split", [("nvme", True), ("host", False)])
def test_the_default_splits_masters_where_the_tier_is_persistent(tmp_path, tier, split):
    """split_master="auto": on nvme the split saves 2 bytes read and written a step; on a memory tier the
    in-place step over all sub-groups stays ([Note: split master])."""
    c = cfg(tmp_path, tier, tier, tier, compute_dtype=torch.bfloat16)
    assert c.split_master == "auto" and applies(c) is split
    assert applies(c.replace(split_master=True)) and not applies(c.replace(split_master=False))
    assert not applies(cfg(tmp_path, tier, tier, tier))  # fp32 compute: the shared master, nothing to split
    with pytest.raises(TierstoreValueError, match="True, False or 'auto'"):
        c.replace(split_master="on")
