"""`tierstore bench optim`: the Zero3Optimizer step against a plain fused AdamW step, the disk and the compute.

Cases, interleaved A B A B in one run (see [Note: ratios, not lone numbers] in _common.py):
  ref       torch.optim.AdamW(fused=True) on N fp32 parameters in memory (the reference)
  host      Zero3Optimizer(AdamW fused), master + states + gradients on the host tier
  nvme      ... master + states on the nvme tier (gradients and parameters on host)
  nvme8     ... the same with state_codec="dynamic8"
  compute   the step compute alone: fused AdamW per sub-group on the same flat tensors, no I/O
  read      the raw engine reading the bytes one nvme step reads (O_DIRECT, page cache dropped)
  write     the raw engine writing the bytes one nvme step writes (+ fsync)
  readwrite both at once (the disk's bound for a perfectly overlapped step; shown for information)
  fio_*     with fio on PATH: fio reading, writing, and doing both at once on the same bytes (1 MiB, depth
            32, io_uring, O_DIRECT) -- an independent view of whether this disk reads and writes at full
            speed at the same time, which the nvme target assumes
Only step() is timed: gradients are produced once per optimizer and stepped on again each round. The nvme
cases' bytes per parameter per step on the disk, by kind (OptimizerStats.disk_read / disk_written), follow.
Then the whole training step (forward + backward + step + zero_grad) of a stack of square Linear layers with
about the same number of parameters (batch 16), interleaved the same way:
  full_ref      torch AdamW(fused=True) in memory (the reference)
  full_host     Zero3Optimizer, parameters, states and gradients on host
  full_nvme     ... everything on nvme
  full_overlap  ... everything on nvme, OffloadConfig(overlap_step=True): the step overlaps backward
(--no-full skips them.)
Targets (issue 6): host >= 0.9x ref; nvme <= 1.25x max(read, write, compute); nvme8 >= 1.6x faster than
nvme; peak RSS growth during the nvme step <= pinned budget + 3 sub-groups (+10%).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from ._common import (
    Progress,
    drop_page_cache,
    engine_pass,
    fmt_bytes,
    interleave,
    print_table,
    proc_status,
    size_arg,
    write_json,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=16e6, help="number of fp32 parameters N (default 16M)")
    p.add_argument("--tensors", type=int, default=8, help="the model's parameter tensors (N split evenly)")
    p.add_argument("--sub-group", type=size_arg, default=8 << 20, help="sub_group_bytes (fp32 parameter bytes)")
    p.add_argument("--pinned", type=size_arg, default=64 << 20, help="the store's pinned budget")
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir in .)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    p.add_argument("--no-full", action="store_true", help="skip the full training step cases")
    p.add_argument("--width", type=int, default=1024, help="width of the full step's Linear layers")




def run(args) -> int:
    import time

    import torch
    import torch.nn as nn

    from ..io import Engine
    from ..tiers.host import aligned_empty
    from ..zero import OffloadConfig, Zero3Optimizer

    n_total = int(args.params)
    k = args.tensors
    per = n_total // k  # elements per tensor
    root = tempfile.mkdtemp(prefix="bench-optim-", dir=args.dir or ".")
    try:
        class Flat(nn.Module):
            def __init__(self):
                super().__init__()
                for i in range(k):
                    self.register_parameter(f"p{i}", nn.Parameter(torch.randn(per) * 0.02))

            def forward(self):
                return sum((p * (i + 1)).sum() for i, p in enumerate(self.parameters())) * 1e-6

        def zero(tiers: tuple[str, str], codec=None):
            torch.manual_seed(0)
            m = Flat()
            cfg = OffloadConfig(params="host", optimizer_states=tiers[0], gradients=tiers[1],
                                nvme_paths=[os.path.join(root, f"{tiers[0]}-{codec}")], state_codec=codec,
                                sub_group_bytes=args.sub_group, min_io_bytes=1 << 20, pinned_bytes=args.pinned,
                                prefetch_depth=0)
            opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, fused=True, config=cfg)
            m().backward()
            opt.step()  # states exist from here on
            return opt

        torch.manual_seed(0)
        ref_params = [nn.Parameter(torch.randn(per) * 0.02) for _ in range(k)]
        for p in ref_params:
            p.grad = torch.randn(per) * 1e-3
        ref = torch.optim.AdamW(ref_params, lr=1e-3, fused=True)
        ref.step()
        opts = {"host": zero(("host", "host")), "nvme": zero(("nvme", "host")),
                "nvme8": zero(("nvme", "host"), "dynamic8")}
        subgroups = len(opts["nvme"].layout.trainable_gids())
        sg_elems = max(opts["nvme"].layout.shard_numel(g) for g in opts["nvme"].layout.trainable_gids())
        # compute alone: one fused AdamW step per sub-group-sized flat tensor, as the pipeline does
        flats = [nn.Parameter(torch.randn(sg_elems) * 0.02) for _ in range(subgroups)]
        comp = []
        for f in flats:
            f.grad = torch.randn(sg_elems) * 1e-3
            o = torch.optim.AdamW([f], lr=1e-3, fused=True)
            o.step()
            comp.append(o)
        # the raw disk: what one nvme step reads and writes (master + exp_avg + exp_avg_sq, fp32)
        io_bytes = subgroups * sg_elems * 4 * 3  # bytes
        eng = Engine()
        req = sg_elems * 4  # bytes per request: one state of one sub-group
        bufs = [aligned_empty(req) for _ in range(3 * subgroups)]
        for b in bufs:
            b.fill_(1)
        rfile = os.path.join(root, "raw.bin")

        pieces = [(b, i * req) for i, b in enumerate(bufs)]

        def raw_write():
            return engine_pass(eng, rfile, "w", pieces)

        def raw_read():
            return engine_pass(eng, rfile, "r", pieces)

        rfile2 = os.path.join(root, "raw2.bin")
        bufs2 = [aligned_empty(req) for _ in range(3 * subgroups)]

        def raw_readwrite():
            # what a perfectly overlapped nvme step asks of the disk: read one file while writing another
            drop_page_cache([rfile])
            fr, fw = eng.open(rfile, "r"), eng.open(rfile2, "w")
            t0 = time.perf_counter()
            for i, (b, b2) in enumerate(zip(bufs, bufs2)):
                eng.read(fr, b, i * req)
                eng.write(fw, b2, i * req)
            eng.wait_all()
            eng.fsync(fw)
            dt = time.perf_counter() - t0
            eng.close_file(fr)
            eng.close_file(fw)
            return dt

        raw_write()
        full = {} if args.no_full else _full_step(args, root, n_total)
        peaks: dict[str, list[int]] = {}

        def step_of(name):
            opt = opts[name]

            def case():
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                before = proc_status("VmRSS")
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                peaks.setdefault(name, []).append(proc_status("VmHWM") - before)
                return dt
            return case

        cases = {"ref": lambda: ref.step(), "host": step_of("host"), "nvme": step_of("nvme"),
                 "nvme8": step_of("nvme8"), "compute": lambda: [o.step() for o in comp] and None,
                 "read": raw_read, "write": raw_write, "readwrite": raw_readwrite}
        fio = not args.no_fio and shutil.which("fio")
        if fio:
            from .io import fio_wall
            fio_jobs = {"fio_read": [(rfile, "read")], "fio_write": [(rfile2, "write")],
                        "fio_readwrite": [(rfile, "read"), (rfile2, "write")]}
            for name, jobs in fio_jobs.items():
                cases[name] = lambda jobs=jobs: fio_wall(jobs, "io_uring", 1 << 20, 32, io_bytes)
        disk0 = {n: opts[n].stats() for n in ("nvme", "nvme8")}
        with Progress(len(cases) * args.rounds, "bench optim") as prog:
            res = interleave(cases, args.rounds, prog)
        disk1 = {n: opts[n].stats() for n in ("nvme", "nvme8")}
        med = {k2: v.median for k2, v in res.items()}
        disk = max(med["read"], med["write"], med["compute"])
        sg_state_bytes = sg_elems * 4 * 4  # bytes: master, gradient, exp_avg, exp_avg_sq of one sub-group
        bound = (args.pinned + 3 * sg_state_bytes) * 1.1
        peak = max(peaks.get("nvme", [0]))
        enc = opts["nvme8"].store.tensor(f"s{opts['nvme8'].layout.trainable_gids()[0]}.exp_avg")
        rows = [
            ["ref: torch AdamW(fused) in memory", f"{med['ref'] * 1e3:.1f}", "1.00x", "reference", ""],
            ["Zero3 host tier", f"{med['host'] * 1e3:.1f}", f"{med['ref'] / med['host']:.2f}x of ref speed",
             ">= 0.9x", "ok" if med["ref"] / med["host"] >= 0.9 else "MISS"],
            ["Zero3 nvme tier", f"{med['nvme'] * 1e3:.1f}", f"{med['nvme'] / disk:.2f}x max(read,write,compute)",
             "<= 1.25x", "ok" if med["nvme"] / disk <= 1.25 else "MISS"],
            ["Zero3 nvme + dynamic8", f"{med['nvme8'] * 1e3:.1f}",
             f"{med['nvme'] / med['nvme8']:.2f}x faster than nvme", ">= 1.6x",
             "ok" if med["nvme"] / med["nvme8"] >= 1.6 else "MISS"],
            ["step compute alone", f"{med['compute'] * 1e3:.1f}", f"{med['compute'] / med['ref']:.2f}x of ref time",
             "", ""],
            [f"raw engine read {fmt_bytes(io_bytes)}", f"{med['read'] * 1e3:.1f}",
             f"{io_bytes / med['read'] / 2**30:.2f} GiB/s", "", ""],
            [f"raw engine write {fmt_bytes(io_bytes)}", f"{med['write'] * 1e3:.1f}",
             f"{io_bytes / med['write'] / 2**30:.2f} GiB/s", "", ""],
            ["raw engine read + write at once", f"{med['readwrite'] * 1e3:.1f}",
             f"nvme step = {med['nvme'] / med['readwrite']:.2f}x of it", "(info)", ""],
        ]
        if fio:
            rows += [
                ["fio read / write, alone", f"{med['fio_read'] * 1e3:.1f} / {med['fio_write'] * 1e3:.1f}", "", "", ""],
                ["fio read + write at once", f"{med['fio_readwrite'] * 1e3:.1f}",
                 f"{med['fio_readwrite'] / max(med['fio_read'], med['fio_write']):.2f}x max(read, write)",
                 "(info)", ""]]
        rows += [
            ["peak RSS growth, nvme step", fmt_bytes(peak), f"{peak / bound * 1.1:.2f}x of pinned + 3 sub-groups",
             "<= 1.1x", "ok" if peak <= bound else "MISS"],
        ]
        per_step = {}  # case -> {kind: (read, written) bytes per parameter per step}
        for n in disk0:
            steps = disk1[n].steps - disk0[n].steps
            per_step[n] = {kd: ((disk1[n].disk_read[kd] - disk0[n].disk_read[kd]) / steps / n_total,
                                (disk1[n].disk_written[kd] - disk0[n].disk_written[kd]) / steps / n_total)
                           for kd in disk1[n].disk_read}
            rows.append([f"{n}: disk bytes / param / step, read | written", "",
                         ", ".join(f"{kd} {r:.2f} | {w:.2f}" for kd, (r, w) in per_step[n].items()), "(info)", ""])
        print_table(f"bench optim: N={n_total:,} fp32 params in {k} tensors, {subgroups} sub-groups of "
                    f"{fmt_bytes(sg_elems * 4)}, median of {args.rounds} rounds (ms)",
                    ["case", "ms", "ratio", "target", ""], rows,
                    caption=f"dynamic8 exp_avg of one sub-group at rest: {enc.encoded_nbytes:,} bytes "
                            f"(fp32: {sg_elems * 4:,})")
        write_json(args.json, {"params": n_total, "subgroups": subgroups, "median_s": med,
                               "samples": {k2: v.seconds for k2, v in res.items()}, "peak_rss_nvme": peaks,
                               "peak_bound": bound, "io_bytes": io_bytes, "disk_bytes_per_param_step": per_step,
                               "full_step": full})
        from .plot import Panel, Series, png_path, save_png
        names = [n for n in res if n != "ref"]
        print(save_png(png_path(args.json, None), f"tierstore bench optim: {n_total / 1e6:.0f}M fp32 parameters", [
            Panel(f"one optimizer step, median of {args.rounds} rounds (torch AdamW in memory: dotted)", "ms",
                  [Series("median", names, [med[n] * 1e3 for n in names], "o")],
                  hlines=[(med["ref"] * 1e3, "torch AdamW(fused), in memory")])]))
        for o in opts.values():
            o.close()
        eng.close()
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _full_step(args, root: str, n_total: int) -> dict:
    """The whole training step, alternated (see the module's docstring); prints its table, returns its figures."""
    import os
    import statistics
    import time

    import torch
    import torch.nn as nn

    from ..zero import OffloadConfig, Zero3Optimizer

    width = args.width
    layers = max(1, round(n_total / (width * width)))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])

    def zero(tier: str, **kw):
        m = build()
        cfg = OffloadConfig(params=tier, optimizer_states=tier, gradients=tier, sub_group_bytes=args.sub_group,
                            pinned_bytes=args.pinned, nvme_paths=[os.path.join(root, f"full-{tier}-{len(kw)}")],
                            **kw)
        return m, Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, fused=True, config=cfg)

    ref_m = build()
    models = {"full_ref": (ref_m, torch.optim.AdamW(ref_m.parameters(), lr=1e-3, fused=True)),
              "full_host": zero("host"), "full_nvme": zero("nvme"), "full_overlap": zero("nvme", overlap_step=True)}
    x = torch.randn(16, width)
    split: dict[str, list[tuple[float, float]]] = {n: [] for n in models}

    def case(name):
        m, o = models[name]

        def run():
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            t1 = time.perf_counter()
            o.step()
            o.zero_grad()
            t2 = time.perf_counter()
            split[name].append((t1 - t0, t2 - t1))
            return t2 - t0
        return run

    cases = {n: case(n) for n in models}
    for fn in cases.values():
        fn()  # the states exist from here on
    for v in split.values():
        v.clear()
    with Progress(len(cases) * args.rounds, "bench optim: full step") as prog:
        res = interleave(cases, args.rounds, prog)
    med = {n: v.median for n, v in res.items()}
    fb = {n: statistics.median(a for a, _b in split[n]) for n in split}
    st = {n: statistics.median(b for _a, b in split[n]) for n in split}
    rows = [[n, f"{fb[n] * 1e3:.1f}", f"{st[n] * 1e3:.1f}", f"{med[n] * 1e3:.1f}", f"{med[n] / med['full_ref']:.2f}x"]
            for n in models]
    print_table(f"full training step: {layers} x Linear({width}, {width}) ({layers * width * (width + 1):,} params), "
                f"batch 16, median of {args.rounds} rounds (ms); load average {os.getloadavg()[0]:.1f}",
                ["case", "fwd+bwd", "step", "full", "full / torch"], rows)
    out = {"fwd_bwd_s": fb, "step_s": st, "full_s": med, "layers": layers, "width": width}
    for _m, o in models.values():
        if isinstance(o, Zero3Optimizer):
            o.close()
    return out
