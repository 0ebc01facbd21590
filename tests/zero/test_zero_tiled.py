"""TiledLinear built under zero.Init: its tiles draw their whole-layer initialisation in their own __init__,
so what Init stores equals a plain build with the same seed."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from tests.support import cfg
from tierstore.zero import Init, TiledLinear, Zero3Optimizer


class Wrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.tl = TiledLinear(96, 80, in_splits=3, out_splits=4)

    def forward(self, x):
        return self.tl(x)


def test_tiles_initialise_over_the_whole_layer_and_survive_init(tmp_path):
    torch.manual_seed(0)
    plain = Wrap()
    bound = 1 / math.sqrt(96)  # nn.Linear(96, 80)'s bound, not a 32-wide tile's (1/sqrt(32))
    for n, p in plain.named_parameters():
        assert p.abs().max() <= bound and p.abs().max() > 0.8 * bound, n
    c = cfg(tmp_path, params="nvme", states="nvme")
    torch.manual_seed(0)
    with Init(c):
        built = Wrap()
    opt = Zero3Optimizer(built, torch.optim.AdamW, config=c)
    try:
        full = opt.full_state_dict()
        for n, p in plain.named_parameters():
            assert torch.equal(full[n], p.detach()), n
    finally:
        opt.close()
