"""The parts Zero3Optimizer is built from (issue 15, step 5): the store-key helper, the sub-group stepper's
typed hand-off, the 8-bit state handling, skipped-parameter handling, and the checkpoint interface."""
from __future__ import annotations

import pytest
import torch

from tests.support import batches, cfg, loss_fn, make_pair
from tierstore.zero import Zero3Optimizer, keys


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _trained(tmp_path, steps=2, **cfg_kw):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, **cfg_kw), lr=1e-2)
    for x, y in batches(steps):
        loss_fn(m, x, y).backward()
        opt.step()
    return opt


def test_every_store_name_is_built_by_the_key_helper(tmp_path):
    """After steps (gradients kept: no zero_grad), the store holds exactly the names keys.* gives for the
    layout: a parameter shard per sub-group, a master and AdamW's three states per trainable one, a gradient
    partition per trainable one."""
    opt = _trained(tmp_path, params="device", states="host", grads="host")  # not [Note: shared master]
    try:
        want = set()
        for gid in range(len(opt.layout.subgroups)):
            want.add(keys.param(gid))
        for gid in opt.layout.trainable_gids():
            want |= {keys.master(gid), keys.grad(gid)} | {keys.state(gid, k) for k in ("step", "exp_avg", "exp_avg_sq")}
        assert set(opt.store.keys()) == want
        # the names are distinct per kind and per sub-group
        assert len({keys.param(1), keys.master(1), keys.grad(1), keys.state(1, "param"), keys.param(11)}) == 5
    finally:
        opt.close()


class _Layout:
    """Just what Prefetcher reads of a Layout: bucket(gid).numel / .dtype."""

    class _B:
        numel, dtype = 4, torch.float32

    def bucket(self, gid):
        return self._B()


def test_prefetcher_reads_ahead_hands_over_and_drops():
    """The Prefetcher alone (world size 1: reads only, no all-gather posted): what `ahead` names is read on
    its worker thread, `shard` hands a read-ahead shard over (a hit) or reads now, held buckets are not read,
    and `drop` forgets the rest."""
    from tierstore.zero.prefetch import Prefetcher
    reads = []

    def fetch(gid):
        reads.append(gid)
        return torch.full((2,), float(gid))

    held = {3}
    pf = Prefetcher(_Layout(), fetch, held.__contains__, device=torch.device("cpu"), depth=1)
    try:
        assert pf.enabled and not pf.gathers_ahead_on and pf.span == 1
        pf.ahead([[0, 3], [1]])  # world 1: every module named is read ahead; 3 is held already
        assert pf.reads_in_flight == 2 and pf.gathers_in_flight == 0
        assert pf.take_gathered(0) is None  # nothing was posted ahead
        assert pf.shard(0).tolist() == [0.0, 0.0] and pf.prefetch_hits == 1
        assert pf.shard(2).tolist() == [2.0, 2.0] and pf.prefetch_hits == 1  # not read ahead: read now
        pf.drop()
        assert pf.reads_in_flight == 0
        assert sorted(reads) == [0, 1, 2] and pf.stage.staged == 2
    finally:
        pf.close()
    off = Prefetcher(_Layout(), fetch, held.__contains__, device=torch.device("cpu"), depth=0)
    off.ahead([[5]])
    assert not off.enabled and off.reads_in_flight == 0 and 5 not in reads
