"""A Hypothesis state machine: random put/get/delete/move/flush/reopen against a plain dict model.

`current` is what get() must return now; `flushed` is what a reopen (after close without flush) returns."""
from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierstore.store import Store

NAMES = st.sampled_from(["a", "b", "c", "d", "e/f"])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float16, torch.int64])
SHAPES = st.sampled_from([(0,), (), (3,), (17, 5), (1000,), (40_000,), (300_000,)])
TIERS = st.sampled_from([None, "device", "host", "nvme"])


def make(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    return x > 0 if dtype == torch.bool else x.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


class StoreVsDict(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ts-hyp-")
        self.store = self._open(Store)
        self.current: dict[str, torch.Tensor] = {}
        self.flushed: dict[str, torch.Tensor] = {}

    def _open(self, how):
        # small budgets so puts spill, a small pool so large tensors stream in pieces
        return how(self.dir, budgets={"device": 1 << 20, "host": 1 << 20, "pinned": 2 << 20}, buffer_bytes=1 << 20)

    @rule(name=NAMES, shape=SHAPES, dtype=DTYPES, tier=TIERS, seed=st.integers(0, 1000))
    def put(self, name, shape, dtype, tier, seed):
        x = make(shape, dtype, seed)
        if tier in ("device", "host") and x.numel() * x.element_size() > (1 << 20):
            tier = None  # larger than that tier's whole budget: TierFullError is tested elsewhere
        self.store.put(name, x, tier)
        self.current[name] = x

    @precondition(lambda self: self.current)
    @rule(data=st.data())
    def get(self, data):
        name = data.draw(st.sampled_from(sorted(self.current)))
        assert same(self.store.get(name), self.current[name])

    @precondition(lambda self: self.current)
    @rule(data=st.data(), op=st.sampled_from(["prefetch", "offload", "drop-fastest", "update"]))
    def move(self, data, op):
        name = data.draw(st.sampled_from(sorted(self.current)))
        t = self.store.tensor(name)
        if op == "prefetch" and t.nbytes <= (1 << 20):
            t.prefetch(data.draw(st.sampled_from(["device", "host"]))).result()
        elif op == "offload":
            t.offload("nvme").result()
            assert t.tiers == {"nvme"}
        elif op == "drop-fastest" and len(t.tiers) > 1:
            t.drop(min(t.tiers, key=["device", "host", "nvme"].index))
        elif op == "update":
            x = make(tuple(t.shape), t.dtype, data.draw(st.integers(0, 1000)))
            t.update(x)
            self.current[name] = x

    @precondition(lambda self: self.current)
    @rule(data=st.data())
    def delete(self, data):
        name = data.draw(st.sampled_from(sorted(self.current)))
        self.store.delete(name)
        del self.current[name]

    @rule()
    def flush(self):
        self.store.flush()
        self.flushed = dict(self.current)

    @rule()
    def reopen_without_flush(self):
        self.store.close(flush=False)
        self.store = self._open(Store.open) if self.flushed or self._has_manifest() else self._open(Store)
        self.current = dict(self.flushed)

    def _has_manifest(self):
        import os
        return os.path.exists(os.path.join(self.dir, "manifest.json"))

    @invariant()
    def same_keys(self):
        assert sorted(self.store.keys()) == sorted(self.current)
        st_ = self.store.stats()
        assert st_["device"]["used"] <= 1 << 20 and st_["host"]["used"] <= 1 << 20

    def teardown(self):
        try:
            self.store.close(flush=True)
            with Store.open(self.dir) as s:
                assert sorted(s.keys()) == sorted(self.current)
                for k, v in self.current.items():
                    assert same(s.get(k), v)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


TestStoreVsDict = StoreVsDict.TestCase
TestStoreVsDict.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
