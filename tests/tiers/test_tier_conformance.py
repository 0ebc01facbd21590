"""The tier conformance suite (tests/tiers/tier_conformance.py) run on each tier of the registry: device (the CPU
standing in, [Note: the CPU stands in for the accelerator]), host and nvme. Each subclass reads the tier's
bytes without the tier: memory by address, the nvme tier's extent files with plain file reads."""
from __future__ import annotations

import os

from tests.tiers.tier_conformance import MemoryTierTests, PersistentTierTests, cpu_bytes
from tierstore.io import BufferPool, Engine
from tierstore.tiers import REGISTRY, TIERS, DeviceTier, Extent, HostTier, NvmeTier
from tierstore.tiers.nvme import EXTENT_FILE


class TestDeviceTier(MemoryTierTests):
    tier_name = "device"

    def make(self, budget):
        return DeviceTier(budget, "cpu")

    def raw(self, tier, copy):
        assert copy.device == tier.device
        return cpu_bytes(copy.cpu().contiguous())


class TestHostTier(MemoryTierTests):
    tier_name = "host"

    def make(self, budget):
        return HostTier(budget, lock=False)

    def raw(self, tier, copy):
        assert copy.device.type == "cpu" and copy.is_contiguous()
        return cpu_bytes(copy)


class TestNvmeTier(PersistentTierTests):
    tier_name = "nvme"

    def make(self, path, budget=None):
        pool = BufferPool(4 << 20, 1 << 20, lock=False)
        engine = Engine("auto", 8, pool=pool)
        tier = NvmeTier([str(path)], engine, pool, budget_bytes=budget, extent_file_bytes=64 << 20)
        close = tier.close

        def close_all():
            close()
            engine.close()
            pool.close()
        tier.close = close_all
        return tier

    def _file(self, path, e):
        return os.path.join(path, EXTENT_FILE.format(e.file))  # one directory: logical offset == file offset

    def raw(self, tier, e):
        if e.length == 0:
            return b""  # nothing was written anywhere
        with open(self._file(tier.dirs[0], e), "rb") as f:
            f.seek(e.offset)
            return f.read(e.length)

    def damage(self, tier, e):
        with open(self._file(tier.dirs[0], e), "r+b") as f:
            f.seek(e.offset + e.length // 2)
            b = f.read(1)
            f.seek(e.offset + e.length // 2)
            f.write(bytes([b[0] ^ 0xFF]))

    def reopen(self, path, extents_json):
        tier = self.make(path)
        exts = [Extent.from_json(d) for d in extents_json]
        tier.check_extents(exts, str(path), lambda i: f"e{i}")
        tier.adopt(exts)
        return tier, exts


def test_every_registered_tier_has_a_conformance_class():
    tested = {c.tier_name for c in (TestDeviceTier, TestHostTier, TestNvmeTier)}
    assert tested == set(TIERS)
    assert [i.order for i in REGISTRY] == list(range(len(REGISTRY)))  # fastest first, no gaps
