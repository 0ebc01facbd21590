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
