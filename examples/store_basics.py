"""The standalone store: named tensors on host memory or NVMe files, prefetched before use.

    python examples/store_basics.py --dir ts-data/store --mib 64
"""
from __future__ import annotations

import argparse

import torch

import tierstore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="ts-data/store")
    p.add_argument("--mib", type=int, default=64, help="MiB of tensors to keep")
    a = p.parse_args()
    layers = {f"layer{i}.weight": torch.randn(a.mib * (1 << 18) // 8) for i in range(8)}  # 8 x mib/8 MiB fp32
    with tierstore.Store([a.dir], budgets={"host": (a.mib << 20) // 4}) as store:  # memory for a quarter of them
        for name, t in layers.items():
            store.put(name, t, tier="nvme")
        store.flush()  # durable: a later process can Store.open the directory
        pending = store.tensor("layer0.weight").prefetch("host")  # start the first read
        for i in range(8):
            pending.result()  # layer i is in memory
            if i + 1 < 8:  # read layer i+1 while layer i is used
                pending = store.tensor(f"layer{i + 1}.weight").prefetch("host")
            t = store.get(f"layer{i}.weight")
            assert torch.equal(t, layers[f"layer{i}.weight"])
            store.tensor(f"layer{i}.weight").drop("host")  # its memory back to the budget; the file stays
        print(f"store: {len(store.keys())} tensors, {sum(v.numel() * 4 for v in layers.values()) >> 20} MiB "
              f"on nvme, read back equal through prefetch")
    with tierstore.Store.open([a.dir]) as store:  # any process, later
        assert torch.equal(store.get("layer7.weight"), layers["layer7.weight"])
        print("reopened: layer7.weight equal")


if __name__ == "__main__":
    main()
