"""`tierstore bench activations`: the memory and the time of a GPT-style training step (tierstore/gpt.py) with long
sequences, five ways: torch as it is ('plain'), torch with every block under torch.utils.checkpoint
('checkpoint'), and tierstore.ActivationOffload of every saved tensor to the host tier ('host') or the nvme
tier ('nvme'), and of the checkpointed blocks' inputs to nvme ('nvme+checkpoint', DeepSpeed's
cpu_checkpointing, one tier down).

Each case runs in a fresh process (peak RSS is a process's own), the cases alternate A B A B over
--rounds rounds, and the medians are reported. Activation memory = the peak RSS of the timed steps minus the
RSS before them (the model, its gradients and AdamW's states are already allocated by an untimed step).
Targets: 'nvme' holds >= 4x less activation memory than 'checkpoint' for <= 1.2x its step time,
at a sequence length where the activations of 'plain' exceed the model states (parameters, gradients and
AdamW's two states: 16 bytes per parameter).

On a machine without an accelerator the CPU stands in for it, so 'host' moves activations from one part of
the same memory to another: it cuts nothing here (it does free accelerator memory on one).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from ._common import fmt_bytes, print_table, write_json

CASES = ("plain", "checkpoint", "host", "nvme", "nvme+checkpoint")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir in .)")
    p.add_argument("--context", type=int, default=256, help="tokens per sequence (256)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=128, help="blocks (128: deep enough that what checkpointing keeps per "
                   "block outweighs the working set of one block, which offloading keeps too; docs/activations.md)")
    p.add_argument("--steps", type=int, default=3, help="steps per process; the first is not timed (3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the cases, alternated (2)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--prefetch", default="1M", help="bytes ActivationOffload reads ahead (1M)")
    p.add_argument("--write-behind", default="1M", help="bytes ActivationOffload lets wait for their write (1M)")
    p.add_argument("--min-bytes", default="64K", help="saved tensors smaller than this stay in memory (64K)")
    p.add_argument("--small-batch", default="0", help="ActivationOffload(small_batch_bytes=): batch the small saved "
                   "tensors and offload them too (0: they stay in memory, the library's default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (1: on a shared machine more "
                   "threads wait for each other)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per process")
    p.add_argument("--floor", action="store_true", help="only measure what offloading everything leaves in memory "
                   "per block until backward (autograd's graph, small tensors kept, Python objects of the records)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one case


def run(args) -> int:
    if args.one:
        return _one(args)
    if args.floor:
        return _floor(args)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"--cases: unknown case {c!r}; use some of {', '.join(CASES)}")
    root = tempfile.mkdtemp(prefix="bench-act-", dir=args.dir or ".")
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    load = [os.getloadavg()]
    try:
        for r in range(args.rounds):
            for c in cases:
                out = os.path.join(root, "one.json")
                cmd = [sys.executable, "-m", "tierstore", "bench", "activations", "--one", c, "--dir", root,
                       "--json", out, "--context", str(args.context), "--batch", str(args.batch), "--width",
                       str(args.width), "--layers", str(args.layers), "--steps", str(args.steps), "--prefetch",
                       args.prefetch, "--write-behind", args.write_behind, "--min-bytes", args.min_bytes,
                       "--small-batch", args.small_batch, "--threads", str(args.threads)]
                print(f"bench activations: round {r + 1}/{args.rounds}, {c} ...", flush=True)
                subprocess.run(cmd, check=True, timeout=args.timeout)
                with open(out) as f:
                    runs[c].append(json.load(f))
            load.append(os.getloadavg())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {c: {k: statistics.median(x[k] for x in runs[c]) for k in ("step_s", "act_bytes", "peak_rss")}
           for c in cases}
    first = runs[cases[0]][0]
    states = first["states_bytes"]
    ref = "checkpoint" if "checkpoint" in med else cases[0]
    rows = []
    for c in cases:
        m = med[c]
        rows.append([c, fmt_bytes(m["peak_rss"]), fmt_bytes(m["act_bytes"]),
                     f"{med[ref]['act_bytes'] / max(m['act_bytes'], 1):.2f}x", f"{m['step_s']:.2f}",
                     f"{m['step_s'] / med[ref]['step_s']:.2f}x", runs[c][-1].get("offload", "")])
    loads = " -> ".join(f"{a[0]:.1f}" for a in load)
    print_table(f"bench activations: GPT {args.layers} x {args.width}, {args.batch} x {args.context} tokens, model "
                f"states {fmt_bytes(states)} (16 B/param); medians of {args.rounds} rounds, cases alternated",
                ["case", "peak RSS", "activation memory", f"{ref} / case", "s per step", f"vs {ref}",
                 "offloaded (stats)"], rows, caption=f"load average (1 min) per round: {loads}")
    verdict = {}
    if "nvme" in med and "checkpoint" in med and "plain" in med:
        cut = med["checkpoint"]["act_bytes"] / max(med["nvme"]["act_bytes"], 1)
        slow = med["nvme"]["step_s"] / med["checkpoint"]["step_s"]
        verdict = {"activation_cut_vs_checkpoint": cut, "step_time_vs_checkpoint": slow,
                   "plain_activations_over_states": med["plain"]["act_bytes"] / states,
                   "target_met": cut >= 4 and slow <= 1.2 and med["plain"]["act_bytes"] > states}
        print(f"nvme vs checkpoint: activation memory {cut:.2f}x less (target >= 4x), step time {slow:.2f}x "
              f"(target <= 1.2x); plain's activations / model states: {verdict['plain_activations_over_states']:.1f}x"
              f" -> {'met' if verdict['target_met'] else 'NOT met'}")
    errors = _compression_errors(root=args.dir or ".")
    print_table("compression of what goes to nvme (a 3-block MLP, one step): max |error| / max |exact|",
                ["compress", "stored activations", "gradients"],
                [[k, f"{v['values']:.2e}", f"{v['gradients']:.2e}"] for k, v in errors.items()])
    write_json(args.json, {"command": " ".join(sys.argv), "compression_errors": errors, "context": args.context,
                           "batch": args.batch, "width": args.width, "layers": args.layers, "rounds": args.rounds,
                           "loadavg": load, "states_bytes": states, "medians": med, "runs": runs, **verdict})
    from ..plot import Panel, Series, png_path, save_png
    mib = 1 << 20
    print(save_png(png_path(args.json, "bench-activations.png"),
                   f"tierstore bench activations: GPT {args.layers} x {args.width}, {args.batch} x {args.context} "
                   "tokens", [
                       Panel("activation memory (peak RSS of a step minus RSS before it)", "MiB",
                             [Series("activations", cases, [med[c]["act_bytes"] / mib for c in cases], "o"),
                              Series("model states", cases, [states / mib] * len(cases), "--")]),
                       Panel("training step", "seconds", [Series("step", cases, [med[c]["step_s"] for c in cases],
                                                                  "o")])]))
    return 0


def _compression_errors(root: str) -> dict[str, dict[str, float]]:
    """The error compress='bf16' / 'int8' puts in the saved tensors and in the gradients of a small model."""
    import torch
    import torch.nn as nn

    from ..activations import ActivationOffload

    def grads(act):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                for _ in range(3)])
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
        if act is None:
            loss = model(x).square().mean()
        else:
            with act:
                loss = model(x).square().mean()
            act.wait_writes()  # every saved tensor read back from the store, not from memory
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    def rel(a, b) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()
    exact = grads(None)
    out = {}
    for compress in ("bf16", "int8"):
        d = tempfile.mkdtemp(prefix="bench-act-err-", dir=root)
        act = ActivationOffload("nvme", paths=[d], compress=compress, min_bytes=0)
        try:
            t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(2))
            with act:
                packed = act._pack(t)
            act.wait_writes()
            values = rel(act._unpack(packed), t)
            del packed
            out[compress] = {"values": values, "gradients": rel(grads(act), exact)}
        finally:
            act.close()
            shutil.rmtree(d, ignore_errors=True)
    return out


def _floor(args) -> int:
    """Bytes per block that stay in memory from the forward to the backward when every saved tensor is offloaded:
    the difference between --layers and --layers / 4 blocks, after the forward (writes done), by source."""
    import ctypes
    import gc
    import tracemalloc

    import torch

    from ..activations import ActivationOffload
    from ..gpt import batches, build_model, stdlib_text
    from ._common import parse_size

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2

    def allocated() -> int:  # bytes malloc'ed and not freed (heap and own mmaps)
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    torch.set_num_threads(args.threads)
    _mmap_from(64 << 10)
    min_bytes = parse_size(args.min_bytes)

    def left(layers: int, how: str) -> tuple[float, float, int]:
        """(malloc bytes, Python bytes, offloaded tensors) left after the forward of `layers` blocks."""
        torch.manual_seed(0)
        model = build_model(args.width, layers, args.context)
        x = batches(stdlib_text(1 << 20)[0], 1, args.batch, args.context)[0][0]
        act = None
        hooks: Any
        d = tempfile.mkdtemp(prefix="bench-act-floor-", dir=args.dir or ".")
        if how == "offload":
            act = ActivationOffload("nvme", paths=[d],
                                    prefetch_bytes=parse_size(args.prefetch), min_bytes=min_bytes,
                                    write_behind_bytes=parse_size(args.write_behind),
                                    small_batch_bytes=parse_size(args.small_batch))
            hooks = act
        else:  # autograd's graph alone ('none') or with the small tensors kept ('small'): nothing else saved
            def pack(t):
                return t if how == "small" and t.numel() * t.element_size() < min_bytes else 0
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p)
        try:
            got = []
            for i in range(3):  # 0 makes what stays (files, threads, caches); 1: malloc; 2: Python (tracemalloc)
                gc.collect()
                if i == 2:
                    tracemalloc.start()
                n0 = act.stats().offloaded if act else 0
                a0, p0 = allocated(), tracemalloc.get_traced_memory()[0]
                with hooks:
                    out = model(x)
                if act is not None:
                    act.wait_writes()
                gc.collect()
                got.append((allocated() - a0, tracemalloc.get_traced_memory()[0] - p0,
                            act.stats().offloaded - n0 if act else 0))
                tracemalloc.stop()
                del out
            return got[1][0], got[2][1], got[1][2]
        finally:
            if act is not None:
                act.close()
            shutil.rmtree(d, ignore_errors=True)
    deep, shallow = args.layers, max(1, args.layers // 4)
    rows = []
    per = {}
    for how in ("none", "small", "offload"):
        a, b = left(deep, how), left(shallow, how)
        per[how] = [(a[k] - b[k]) / (deep - shallow) for k in range(3)]
    graph = per["none"][0]
    rows.append(["autograd's graph (hooks that keep nothing)", fmt_bytes(int(graph)), ""])
    rows.append(["saved tensors under --min-bytes, kept", fmt_bytes(int(per["small"][0] - graph)), ""])
    off_malloc, off_py, off_n = per["offload"]
    rows.append(["offload to nvme: malloc'ed (graph, kept tensors included)", fmt_bytes(int(off_malloc)),
                 f"{off_n:.1f} offloaded"])
    rows.append(["offload to nvme: Python objects (tracemalloc)", fmt_bytes(int(off_py)),
                 f"{off_py / max(off_n, 1):.0f} B per offloaded tensor"])
    print_table(f"bench activations --floor: bytes per block left in memory after the forward, GPT width {args.width}, "
                f"{args.batch} x {args.context} tokens ({deep} - {shallow} blocks)", ["what", "per block", ""], rows,
                caption="Python objects under 512 bytes live in pymalloc's arenas: not in the malloc'ed line")
    write_json(args.json, {"command": " ".join(sys.argv), "per_block": per})
    return 0


def _mmap_from(nbytes: int) -> None:
    """glibc: serve blocks from `nbytes` up with their own mmap, so a freed activation leaves RSS at once.

    A layer's activations here are a few hundred KiB each, below gpt.py's 1 MiB threshold: from the heap, the
    ones freed early (offloaded, or dropped by checkpointing) leave holes under the ones still alive, and RSS
    keeps the holes -- it would measure the most ever allocated, not what is alive. Every case runs with it."""
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD: bytes
    except (OSError, AttributeError):
        pass


def _one(args) -> int:
    """One case in this process: build, an untimed step, --steps - 1 timed ones; peak RSS over them."""
    import time

    import torch
    import torch.nn.functional as F

    from ..activations import ActivationOffload
    from ..gpt import VOCAB, batches, build_model, count_params, keep_heap_small, reset_peak_rss, stdlib_text
    from ._common import parse_size, proc_status

    torch.set_num_threads(args.threads)
    keep_heap_small()  # [Note: resident memory follows live memory] in gpt.py
    _mmap_from(64 << 10)
    case = args.one
    torch.manual_seed(0)
    model = build_model(args.width, args.layers, args.context, checkpoint=case in ("checkpoint", "nvme+checkpoint"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    act = None
    if case in ("host", "nvme", "nvme+checkpoint"):
        act = ActivationOffload("host" if case == "host" else "nvme",
                                paths=[os.path.join(args.dir, "act")] if case != "host" else None,
                                mode="checkpoint" if case == "nvme+checkpoint" else "all",
                                prefetch_bytes=parse_size(args.prefetch),
                                write_behind_bytes=parse_size(args.write_behind), min_bytes=parse_size(args.min_bytes),
                                small_batch_bytes=parse_size(args.small_batch))
    data = batches(stdlib_text(1 << 20)[0], args.steps, args.batch, args.context)
    times = []
    base = 0
    try:
        for i, (x, y) in enumerate(data):
            if i == 1:
                base = proc_status("VmRSS")
                reset_peak_rss()
            t0 = time.perf_counter()
            if act is not None:
                with act:
                    logits = model(x)
            else:
                logits = model(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
            del logits
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
        peak = proc_status("VmHWM")
        stats = act.stats() if act is not None else None
    finally:
        if act is not None:
            act.close()
    n = count_params(args.width, args.layers, args.context)
    offload = ""
    if stats is not None:
        offload = (f"{fmt_bytes(stats.offloaded_bytes // max(1, args.steps))}/step, read ahead "
                   f"{stats.prefetch_hits}, in memory {stats.unwritten_hits}, waited {stats.misses}")
    timed = times[1:] or times
    write_json(args.json, {"case": case, "step_s": statistics.median(timed), "step_seconds": times,
                           "peak_rss": peak, "base_rss": base, "act_bytes": max(0, peak - base),
                           "states_bytes": 16 * n, "parameters": n, "offload": offload,
                           "stats": None if stats is None else stats.__dict__})
    return 0
