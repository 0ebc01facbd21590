"""A plain training loop under torchrun: ZeRO-3 over N processes (gloo on CPU, NCCL on GPUs).

    torchrun --nproc_per_node 2 examples/torchrun_train.py --steps 10 --dir ts-data/torchrun

Each rank keeps 1/N of the parameters, gradients and optimizer states (here on its nvme tier); the
checkpoint written at the end holds every rank's shard and reloads at any world size.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from tierstore.zero import OffloadConfig, Zero3Optimizer, consolidate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dir", default="ts-data/torchrun")
    a = p.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank builds the same model; each keeps its own shard
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    config = OffloadConfig(params="host", optimizer_states="nvme", gradients="host",
                           nvme_paths=[os.path.join(a.dir, "nvme")])  # each rank uses <path>/rank<r>
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-3, config=config)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    for step in range(a.steps):
        x = torch.randn(16, 64, generator=g)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()  # gradients are reduce-scattered to their owners during backward
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}, grad norm {float(norm):.4f}", flush=True)
    ckpt = os.path.join(a.dir, "ckpt")
    saved = opt.save_checkpoint(ckpt)  # collective: every rank writes its shard
    opt.close()
    if rank == 0:
        weights = consolidate(ckpt)  # full fp32 weights from every rank's shard, in one process
        print(f"world {world}: checkpoint {saved}, {sum(v.numel() for v in weights.values())} weights")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
