"""Small models and data that several test files train, at world size 1 and N.

Seeded everywhere: `make_pair(seed)` and `batches(n, seed=...)` give the same values in every process, so
a rank of a multi-process test and the single-process reference in the parent build the same model and data.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


class Net(nn.Module):
    """Small MLP with a layer norm; enough parameters for several sub-groups when min_io_bytes is small."""

    def __init__(self, d=16, h=32, o=4):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, h)
        self.head = nn.Linear(h, o)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.relu(self.norm(self.fc1(x))))))


class Odd(nn.Module):
    """Tied weights, an unused layer and a module called twice per forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.block = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, idx):
        h = torch.tanh(self.block(self.emb(idx)))
        return self.out(torch.tanh(self.block(h)))  # block called twice


class Checkpointed(nn.Module):
    """Residual blocks run under torch.utils.checkpoint (their forward runs again inside backward)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4))
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


class Deep(nn.Module):
    """`layers` square Linear layers (12 x 4 MiB weights by default): memory per layer is what is measured."""

    def __init__(self, layers=12, width=1024):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Branchy(nn.Module):
    """a, then b or c (`use_b`), then head: flipping `use_b` changes the module order the prefetch trace saw."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) if self.use_b else torch.tanh(self.c(h))
        return self.head(h)


def make_pair(seed=0, **kw):
    """Two identical Nets: one for torch, one for the optimizer under test."""
    torch.manual_seed(seed)
    m = Net(**kw)
    return m, copy.deepcopy(m)


def batches(n, d=16, o=4, seed=1, bs=24):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, d, generator=g), torch.randn(bs, o, generator=g)) for _ in range(n)]


def loss_fn(m, x, y):
    return ((m(x) - y) ** 2).mean()
