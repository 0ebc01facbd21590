"""The tier conformance suite: what every tier class promises the residency layer, checked through the
contracts of tierstore/tiers/base.py (MemoryTier, PersistentTier) and the registry's capabilities.

A new tier adds a record to `tiers.base.REGISTRY`, a class keeping its Protocol, and a subclass of
`MemoryTierTests` or `PersistentTierTests` in tests/tiers/test_tier_conformance.py that says how to build it and
how to see its bytes *without* the tier (`raw`): the checks then test the tier against an independent view
of what it holds, not against itself.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from tierstore.errors import CorruptionError, MisuseError
from tierstore.tiers import MemoryTier, PersistentTier, tier_info

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def cpu_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor, read from its memory by address (not through torch)."""
    n = t.numel() * t.element_size()  # bytes
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def sample(dtype: torch.dtype, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


class MemoryTierTests:
    """Subclass and define `make(self, budget)` (a fresh tier) and `raw(self, tier, copy) -> bytes` (the bytes
    of one of its copies, read without the tier). The registry name of the tier is `tier_name`."""

    tier_name: str

    def make(self, budget: int | None):
        raise NotImplementedError

    def raw(self, tier, copy: torch.Tensor) -> bytes:
        raise NotImplementedError

    @pytest.fixture
    def tier(self):
        return self.make(None)

    def test_keeps_the_memory_contract(self, tier):
        info = tier_info(self.tier_name)
        assert tier.name == self.tier_name and info.memory and not info.holds_encoded_bytes
        assert isinstance(tier, MemoryTier) and not isinstance(tier, PersistentTier)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_copy_in_holds_the_bytes_of_its_source(self, tier, dtype):
        src = sample(dtype)
        copy = tier.copy_in(src)
        assert copy.shape == src.shape and copy.dtype == dtype
        assert self.raw(tier, copy) == cpu_bytes(src.contiguous())
        src.zero_() if dtype != torch.bool else src.logical_not_()
        assert self.raw(tier, copy) != cpu_bytes(src.contiguous()), "the copy aliases its source"

    def test_copy_in_of_a_strided_view_and_of_nothing(self, tier):
        base = sample(torch.float32, (6, 8))
        view = base.t()[::2]  # not contiguous
        assert self.raw(tier, tier.copy_in(view)) == cpu_bytes(view.contiguous())
        empty = tier.copy_in(torch.empty(0, 4))
        assert empty.shape == (0, 4) and self.raw(tier, empty) == b""

    def test_copy_out_returns_the_destination_holding_the_value(self, tier):
        src = sample(torch.float32)
        copy = tier.copy_in(src)
        dst = torch.empty(src.shape, dtype=src.dtype)
        assert tier.copy_out(copy, dst) is dst and cpu_bytes(dst) == cpu_bytes(src)

    def test_empty_is_memory_of_this_tier(self, tier):
        x = tier.empty((2, 3), torch.float16)
        assert x.shape == (2, 3) and x.dtype == torch.float16
        assert x.device == tier.copy_in(torch.zeros(1)).device

    def test_stats_count_bytes_and_operations_each_way(self, tier):
        src = sample(torch.float32, (64, 4))
        copy = tier.copy_in(src)
        tier.copy_out(copy, torch.empty_like(src))
        s = tier.stats.as_dict()
        assert (s["bytes_in"], s["ops_in"], s["bytes_out"], s["ops_out"]) == (src.nbytes, 1, src.nbytes, 1)

    def test_budget_is_kept_by_its_holder_not_charged_by_copies(self):
        tier = self.make(1000)
        assert tier.budget.limit == 1000 and tier.budget.used == 0
        tier.copy_in(sample(torch.float32, (100,)))
        assert tier.budget.used == 0  # the residency layer charges what it installs
        assert tier.budget.fits_at_all(1000) and not tier.budget.fits_at_all(1001)
        tier.budget.take(400)
        assert tier.budget.room() == 600
        tier.budget.give(400)
        assert not self.make(0).budget.fits_at_all(1) and self.make(None).budget.fits_at_all(1 << 50)


class PersistentTierTests:
    """Subclass and define `make(self, path, budget)` (a tier keeping its files under `path`; closed by the
    suite), `raw(self, tier, extent) -> bytes` (an extent's payload read from the files without the tier),
    `damage(self, tier, extent)` (change one byte of it in the files, without the tier) and
    `reopen(self, path, extents_json) -> (tier, extents)` (a new tier over the same files adopting them)."""

    tier_name: str

    def make(self, path, budget: int | None = None):
        raise NotImplementedError

    def raw(self, tier, extent) -> bytes:
        raise NotImplementedError

    def damage(self, tier, extent) -> None:
        raise NotImplementedError

    def reopen(self, path, extents_json: list[dict]):
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path):
        t = self.make(tmp_path)
        yield t
        t.close()

    def _out(self, e) -> torch.Tensor:
        return torch.empty(e.length, dtype=torch.uint8)

    def test_keeps_the_persistent_contract(self, tier):
        info = tier_info(self.tier_name)
        assert tier.name == self.tier_name and info.persistent and info.holds_encoded_bytes
        assert isinstance(tier, PersistentTier) and not isinstance(tier, MemoryTier)

    @pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 300_000])
    def test_a_synced_write_is_its_bytes_in_the_files(self, tier, nbytes):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        e = tier.write(src, "t")
        tier.sync()
        assert e.length == nbytes and self.raw(tier, e) == cpu_bytes(src)

    def test_read_and_read_many_return_what_was_written(self, tier):
        srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (10, 5000, 70_000, 0, 3)]
        exts = [tier.write(s, f"t{i}") for i, s in enumerate(srcs)]  # readable before sync
        out = self._out(exts[1])
        tier.read(exts[1], out, "t1")
        assert cpu_bytes(out) == cpu_bytes(srcs[1])
        order = [4, 2, 0, 3, 1]
        outs = [self._out(exts[i]) for i in order]
        errors = tier.read_many([(exts[i], o, f"t{i}") for i, o in zip(order, outs)])
        assert errors == [None] * len(order)
        assert [cpu_bytes(o) for o in outs] == [cpu_bytes(srcs[i]) for i in order]

    def test_damaged_bytes_are_a_corruption_error_naming_the_tensor(self, tier):
        e = tier.write(torch.arange(200, dtype=torch.uint8), "tensor 'w'")
        tier.sync()
        self.damage(tier, e)
        with pytest.raises(CorruptionError, match="'w'"):
            tier.read(e, self._out(e), "tensor 'w'")
        errors = tier.read_many([(e, self._out(e), "tensor 'w'")])
        assert isinstance(errors[0], CorruptionError)

    def test_a_freed_uncommitted_extent_is_refused_to_readers(self, tier):
        e = tier.write(torch.ones(100, dtype=torch.uint8), "t")
        tier.sync()
        tier.free(e)
        with pytest.raises(MisuseError):
            tier.read(e, self._out(e), "t")

    def test_committed_space_is_not_reused_until_a_newer_commit(self, tier):
        a = tier.write(torch.full((8192,), 7, dtype=torch.uint8), "a")
        tier.sync()
        tier.protect([a])
        tier.commit_done([a])
        tier.free(a)  # a newer value replaced it, not yet committed: a's bytes must survive a crash
        b = tier.write(torch.full((8192,), 9, dtype=torch.uint8), "b")
        tier.sync()
        assert self.raw(tier, a) == bytes([7]) * 8192 and self.raw(tier, b) == bytes([9]) * 8192
        tier.unfree(a)  # a revert to it: readable again
        out = self._out(a)
        tier.read(a, out, "a")
        assert cpu_bytes(out) == bytes([7]) * 8192

    def test_stats_count_bytes_each_way(self, tier):
        e = tier.write(torch.ones(5000, dtype=torch.uint8), "t")
        tier.sync()
        tier.read(e, self._out(e), "t")
        s = tier.stats.as_dict()
        assert s["bytes_in"] >= 5000 and s["bytes_out"] == 5000

    def test_extents_adopted_by_a_new_tier_read_back(self, tmp_path):
        tier = self.make(tmp_path)
        srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (100, 20_000)]
        exts = [tier.write(s, "t") for s in srcs]
        tier.sync()
        tier.protect(exts)
        tier.commit_done(exts)
        saved = [e.to_json() for e in exts]
        tier.close()
        again, adopted = self.reopen(tmp_path, saved)
        try:
            for e, s in zip(adopted, srcs):
                out = self._out(e)
                again.read(e, out, "t")
                assert cpu_bytes(out) == cpu_bytes(s)
            fresh = again.write(torch.zeros(20_000, dtype=torch.uint8), "new")  # must not land on adopted ones
            again.sync()
            for e, s in zip(adopted, srcs):
                assert self.raw(again, e) == cpu_bytes(s)
            assert self.raw(again, fresh) == bytes(20_000)
        finally:
            again.close()
