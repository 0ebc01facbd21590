"""`tierstore bench hpz`: the bytes ZeRO-3's all-gathers send inside and across nodes per training step,
without and with hpZ ([Note: hpZ] in zero/hooks/hpz.py), with and without qwZ, on simulated nodes: ``--nodes`` x
``--ranks-per-node`` gloo processes on this machine (LOCAL_WORLD_SIZE set as torchrun sets it).

Every all-gather call (torch.distributed.all_gather_into_tensor, and all_gather_single where torch has it)
is counted by the process group it runs in: its input's bytes times the group's ranks on another node
(inter-node) or on this node (intra-node), split into forward and backward by the coordinator's events.
Also printed: hpZ's secondary partition per rank (HpzStats.secondary_bytes) and the median step time as a
ratio to no hpZ in the same run (cases alternated A B A B). On loopback every link is as fast as every other,
so the time shows what hpZ costs (the copies that fill the secondary) and nothing of what it saves.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

CASES: dict[str, dict] = {"no hpZ": {}, "hpZ": {"hpz_partition_size": "node"}, "qwZ": {"quantized_weights": True},
         "qwZ + hpZ": {"quantized_weights": True, "hpz_partition_size": "node"}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per simulated node (default 2)")
    p.add_argument("--width", type=int, default=512, help="width of the Linear stack (default 512)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round, after one warm-up (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="A B A B rounds (default 2)")


class AllGatherBytes:
    """Counts torch.distributed's all-gathers by process group while installed (``with AllGatherBytes(...)``):
    ``bytes[(phase, 'inter' | 'intra')]``, the input's bytes times the group's ranks on another node / on this
    node (nodes of `node_size` consecutive global ranks), and ``calls[phase]``. `phase()` says where the step
    is ('forward' or 'backward')."""

    NAMES = ("all_gather_into_tensor", "all_gather_single")

    def __init__(self, node_size: int, phase):
        import torch.distributed as dist

        self.dist = dist
        self.node_size = node_size
        self.phase = phase
        self.rank = dist.get_rank()
        self.bytes = {(p, w): 0 for p in ("forward", "backward") for w in ("inter", "intra")}
        self.calls = {"forward": 0, "backward": 0}
        self.world_calls = {"forward": 0, "backward": 0}  # calls in a group of every rank
        self._orig: dict = {}

    def __enter__(self) -> AllGatherBytes:
        for name in self.NAMES:
            fn = getattr(self.dist, name, None)
            if fn is not None:
                self._orig[name] = fn
                setattr(self.dist, name, self._wrap(fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(self.dist, name, fn)
        self._orig.clear()

    def _wrap(self, fn):
        dist = self.dist

        def counted(out, inp, group=None, async_op=False):
            world = dist.get_world_size()
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            node = self.rank // self.node_size
            others = sum(1 for r in ranks if r // self.node_size != node)
            phase = self.phase()
            nbytes = inp.numel() * inp.element_size()
            self.bytes[(phase, "inter")] += nbytes * others
            self.bytes[(phase, "intra")] += nbytes * (len(ranks) - 1 - others)
            self.calls[phase] += 1
            if len(ranks) == world:
                self.world_calls[phase] += 1
            return fn(out, inp, group=group, async_op=async_op)
        return counted


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import datetime
    import json

    import torch
    import torch.distributed as dist

    from tierstore.zero import OffloadConfig, Zero3Optimizer
    from tierstore.zero.hooks.events import HookEvents

    torch.set_num_threads(1)
    os.environ.update(LOCAL_WORLD_SIZE=str(args.ranks_per_node), LOCAL_RANK=str(rank % args.ranks_per_node))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))

    class Phase(HookEvents):
        backward = False

        def backward_begin(self, entries):
            self.backward = True

        def backward_end(self, aborted):
            self.backward = False

    g = torch.Generator().manual_seed(1)
    w = args.width
    data = [(torch.randn(16, w, generator=g), torch.randn(16, w, generator=g)) for _ in range(args.steps + 1)]
    results: dict = {name: {"seconds": []} for name in CASES}
    for _round in range(args.rounds):
        for name, kw in CASES.items():
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(args.layers)])
            numel = sum(p.numel() for p in model.parameters())  # before the optimizer empties them
            cfg = OffloadConfig(**kw)
            opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-3, config=cfg)
            phase = Phase()
            sub = opt.coordinator.subscribe(phase)
            for i, (x, y) in enumerate(data):
                counter = AllGatherBytes(args.ranks_per_node, lambda p=phase: "backward" if p.backward else "forward")
                dist.barrier()
                t0 = time.perf_counter()
                with counter:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                opt.step()
                opt.zero_grad()
                dist.barrier()
                if i:  # the first step warms up
                    results[name]["seconds"].append(time.perf_counter() - t0)
            results[name].update(bytes={f"{p} {k}": v for (p, k), v in counter.bytes.items()},
                                 world_calls=counter.world_calls,
                                 secondary=0 if opt.hpz is None else opt.hpz.stats().secondary_bytes,
                                 params=numel)
            sub.remove()
            opt.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


def run(args) -> int:
    import multiprocessing
    import socket

    from tierstore.bench._common import print_table, write_json

    world = args.nodes * args.ranks_per_node
    if args.nodes < 1 or args.ranks_per_node < 2:
        raise SystemExit("tierstore bench hpz: --nodes >= 1 and --ranks-per-node >= 2 (hpZ needs a node of 2)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, outs[r])) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"tierstore bench hpz: ranks exited with {[p.exitcode for p in procs]}")
        import json

        res = [json.load(open(o)) for o in outs]
    r0 = res[0]
    ref = statistics.median(r0["no hpZ"]["seconds"])
    rows = []
    for name in CASES:
        c = r0[name]
        b = c["bytes"]
        rows.append([name, f"{b['forward inter']:,}", f"{b['forward intra']:,}", f"{b['backward inter']:,}",
                     f"{b['backward intra']:,}", f"{c['secondary']:,}",
                     f"{statistics.median(c['seconds']) / ref:.2f}x"])
    load = os.getloadavg()
    print_table(f"bench hpz: {args.nodes} nodes x {args.ranks_per_node} ranks, {args.layers} x Linear({args.width}), "
                f"{r0['no hpZ']['params']:,} parameters; bytes rank 0 sent per step",
                ["case", "fwd inter-node", "fwd intra-node", "bwd inter-node", "bwd intra-node", "secondary bytes",
                 "step time vs no hpZ"], rows,
                caption=f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; loopback: time shows hpZ's cost only")
    write_json(args.json, {"ranks": res, "loadavg": load, "args": vars(args)})
    return 0
