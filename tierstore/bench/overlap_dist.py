"""The overlapped step at world size N, measured: full training steps (forward + backward + step + zero_grad)
of a stack of Linear layers at world size `--world` (gloo, one process per rank on this machine), with
OffloadConfig(overlap_step=True) against overlap_step=False, each also with the prefetch after the step turned
off (the next forward then starts cold), in the same ranks, alternated A B C D A B C D.

    python -m tierstore.bench.overlap_dist --world 2 --params 16e6 --width 1024 --tier nvme --rounds 5

Each rank builds the four optimizers over four copies of one model (each its own store), warms each up, and
times each step between two barriers (so a step's time is the slowest rank's); rank 0 prints, per case, the
median full step and the median first forward after a step, the ratios against overlap_step=False, and the
load average before and after (see [Note: ratios, not lone numbers] in _common.py). [Note: overlapped step at
world size N] in zero/hooks/finals.py; [Note: prefetch after the step] in zero/hooks/prefetch.py.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = ("after", "after-cold", "overlap", "overlap-cold")
LABELS = {"after": "overlap_step=False (step after backward)",
          "after-cold": "overlap_step=False, no prefetch after the step",
          "overlap": "overlap_step=True", "overlap-cold": "overlap_step=True, no prefetch after the step"}


def _model(params: float, width: int) -> torch.nn.Module:
    layers = max(2, round(params / (width * width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


def _rank(rank: int, args, port: int, root: str) -> None:
    from tierstore.zero import OffloadConfig, Zero3Optimizer
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        base = _model(args.params, args.width)
        opts = {}
        for case in CASES:
            t = args.tier
            cfg = OffloadConfig(params=t, optimizer_states=t, gradients=t, nvme_paths=[os.path.join(root, case)],
                                overlap_step=case.startswith("overlap"), sub_group_bytes=args.sub_group,
                                prefetch_depth=2)
            opt = Zero3Optimizer(copy.deepcopy(base), torch.optim.AdamW, lr=1e-4, config=cfg)
            if case.endswith("-cold"):
                opt.coordinator.prefetch_forward = lambda: None  # type: ignore[method-assign]  # the cold reference
            opts[case] = opt
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        times: dict[str, list[float]] = {c: [] for c in CASES}
        fwd: dict[str, list[float]] = {c: [] for c in CASES}

        def once(case: str) -> tuple[float, float]:
            opt = opts[case]
            dist.barrier()
            t0 = time.perf_counter()
            out = opt.model(x)
            t1 = time.perf_counter()
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            return time.perf_counter() - t0, t1 - t0

        for _ in range(args.warmup):
            for case in CASES:
                once(case)
        load0 = os.getloadavg()
        for _ in range(args.rounds):
            for case in CASES:
                full, first = once(case)
                times[case].append(full)
                fwd[case].append(first)
        load1 = os.getloadavg()
        if rank == 0:
            ref = statistics.median(times["after"])
            ref_f = statistics.median(fwd["after"])
            n = sum(p.numel() for p in base.parameters())
            print(f"world {args.world}, {n / 1e6:.1f}M parameters ({args.width} wide), tier {args.tier}, batch "
                  f"{args.batch} per rank, {args.rounds} rounds alternated; load average {load0[0]:.1f} before, "
                  f"{load1[0]:.1f} after")
            print(f"{'case':<50} {'full step':>10} {'vs after':>9} {'forward':>9} {'vs after':>9}")
            for case in CASES:
                full, first = statistics.median(times[case]), statistics.median(fwd[case])
                print(f"{LABELS[case]:<50} {full * 1e3:>8.0f}ms {full / ref:>8.2f}x {first * 1e3:>7.0f}ms "
                      f"{first / ref_f:>8.2f}x")
        for opt in opts.values():
            opt.close()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--params", type=float, default=16e6)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="rows per rank")
    p.add_argument("--tier", default="nvme", choices=("host", "nvme"), help="tier of params, states and grads")
    p.add_argument("--sub-group", type=int, default=8 << 20, help="sub_group_bytes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dir", default=".", help="where the nvme tier's files go (a temporary directory in it)")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="tierstore-overlap-", dir=args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_rank, args=(args, port, root), nprocs=args.world, join=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
