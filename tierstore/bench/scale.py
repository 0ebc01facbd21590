"""`tierstore bench scale`: one GPT family (tierstore/gpt.py: width 1024, layers added) from ~64M parameters to
>= 1B, everything on the nvme tier, a few training steps each, each size in a fresh process so one size's
memory does not count against the next. Per size: peak RSS, bytes on disk, step time and step time per
parameter; plotted next to the JSON. What it shows: peak RSS stays flat while the model and its bytes on
disk grow (target: 256M -> 1B within +10%). Activation checkpointing keeps one input per block, which grows
with depth; by default those inputs go to nvme too (--offload-activations), so nothing resident does.

`--max-params` stops the ladder early (e.g. 128M on a small machine); `--sizes` gives it explicitly.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from ._common import fmt_bytes, print_table, write_json

LADDER = (64e6, 128e6, 256e6, 512e6, 1024e6)  # parameters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir in .)")
    p.add_argument("--max-params", type=float, default=1.1e9, help="largest size of the ladder 64M, 128M, ... 1B "
                   "(default: all of it)")
    p.add_argument("--sizes", default=None, help="comma-separated parameter counts instead of the ladder")
    p.add_argument("--steps", type=int, default=3, help="training steps per size; the first is not timed (3)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--states", choices=("fp32", "dynamic8"), default="fp32")
    p.add_argument("--checkpoint-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="run each block under torch.utils.checkpoint, as the demo does (default on)")
    p.add_argument("--offload-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="OffloadConfig(activation_offload='nvme'): with checkpointing, the blocks' inputs go to nvme "
                        "(docs/activations.md), so nothing resident grows with depth (default on)")
    p.add_argument("--pinned", default="64M", help="the store's page-locked budget")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per size")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process: one size


def run(args) -> int:
    if args.one:
        return _one(args)
    sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else [s for s in LADDER if s <= args.max_params]
    root = tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir or ".")
    results = []
    try:
        for n in sizes:
            out = os.path.join(root, "one.json")
            cmd = [sys.executable, "-m", "tierstore", "bench", "scale", "--one", "--sizes", str(n),
                   "--dir", root, "--steps", str(args.steps), "--context", str(args.context), "--batch",
                   str(args.batch), "--states", args.states, "--pinned", args.pinned, "--json", out,
                   "--checkpoint-activations" if args.checkpoint_activations else "--no-checkpoint-activations",
                   "--offload-activations" if args.offload_activations else "--no-offload-activations"]
            print(f"bench scale: {n / 1e6:.0f}M parameters ...", flush=True)
            subprocess.run(cmd, check=True, timeout=args.timeout)
            with open(out) as f:
                results.append(json.load(f))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [[f"{r['parameters'] / 1e6:.0f}M ({r['layers']} x {r['width']})", fmt_bytes(r["on_disk"]),
             fmt_bytes(r["states_bytes"]), fmt_bytes(r["peak_rss"]), f"{r['on_disk'] / r['peak_rss']:.1f}x",
             f"{r['step_s']:.2f}", f"{r['step_s'] / r['parameters'] * 1e9:.1f}"] for r in results]
    flat = results[-1]["peak_rss"] / results[0]["peak_rss"] if results else float("nan")
    print_table(f"bench scale: GPT family on the nvme tier ({args.states} states), {args.batch} x {args.context} "
                f"tokens per step", ["parameters", "files on disk", "training states", "peak RSS", "disk / RSS",
                                     "s per step", "ns per param"], rows,
                caption=f"peak RSS, largest / smallest size: {flat:.2f}x (flat: <= 1.10x)")
    payload = {"command": " ".join(sys.argv), "states": args.states, "batch": args.batch, "context": args.context,
               "results": results, "rss_largest_over_smallest": flat}
    write_json(args.json, payload)
    from ..plot import Panel, Series, png_path, save_png
    x = [r["parameters"] / 1e6 for r in results]
    gib = 1 << 30
    print(save_png(png_path(args.json, "bench-scale.png"), "tierstore bench scale: GPT family, everything on nvme", [
        Panel("memory and disk", "GiB", [Series("peak RSS", x, [r["peak_rss"] / gib for r in results], "o-"),
                                         Series("files on disk", x, [r["on_disk"] / gib for r in results], "o-")],
              logx=True),
        Panel("training step", "ns per parameter", [
            Series("step time / parameters", x, [r["step_s"] / r["parameters"] * 1e9 for r in results], "o-")],
            xlabel="parameters (millions)", logx=True)]))
    return 0


def _one(args) -> int:
    """One size in this process: build, train --steps, measure."""
    import time

    import torch
    import torch.nn.functional as F

    from .. import zero
    from ..gpt import (
        VOCAB,
        batches,
        build_model,
        bytes_by_tier_and_kind,
        count_params,
        dir_bytes,
        keep_heap_small,
        shape_for,
        stdlib_text,
    )
    from ._common import parse_size, proc_status

    torch.set_num_threads(min(4, os.cpu_count() or 1))
    keep_heap_small()  # [Note: resident memory follows live memory] in gpt.py
    n = float(args.sizes)
    width, layers = shape_for(n)
    nvme = os.path.join(args.dir, "nvme")
    cfg = zero.OffloadConfig(params="nvme", optimizer_states="nvme", gradients="nvme", nvme_paths=[nvme],
                             state_codec=None if args.states == "fp32" else args.states,
                             pinned_bytes=parse_size(args.pinned), prefetch_depth=2,
                             activation_offload="nvme" if args.offload_activations else None,
                             activation_mode="checkpoint" if args.checkpoint_activations else "all")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with zero.Init(cfg):
        model = build_model(width, layers, args.context, checkpoint=args.checkpoint_activations)
    opt = zero.Zero3Optimizer(model, torch.optim.AdamW, config=cfg, lr=1e-4)
    build_s = time.perf_counter() - t0
    times, losses = [], []
    kinds: dict[str, dict[str, int]] = {}  # {kind: {tier: bytes}} at the last step
    try:
        for i, (x, y) in enumerate(batches(stdlib_text(1 << 20)[0], args.steps, args.batch, args.context)):
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
            loss.backward()
            if i == args.steps - 1:
                kinds = bytes_by_tier_and_kind(opt.store)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        on_disk = dir_bytes(nvme)
    finally:
        opt.close()
    timed = times[1:] or times
    write_json(args.json, {
        "parameters": count_params(width, layers, args.context), "width": width, "layers": layers,
        "peak_rss": proc_status("VmHWM"), "on_disk": on_disk,
        "states_bytes": sum(sum(v.values()) for v in kinds.values()), "bytes_by_kind": kinds,
        "step_s": sorted(timed)[len(timed) // 2], "step_seconds": times, "losses": losses, "build_s": build_s})
    return 0
