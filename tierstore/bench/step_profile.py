"""Where one case's training step goes, in one process: forward, backward and step times, the disk's busy
share in each phase (/proc/diskstats of the device holding --dir), CPU seconds per step by thread
(/proc/self/task/*/stat: the caller's thread, torch's OpenMP team, each tierstore thread by name), and the
seconds each thread was ready to run but waited for a core (/proc/self/task/*/schedstat), per step and, for
the caller's thread, in backward: large ones say the threads compete for the cores (run the case with a
smaller --batch to see whether the compute is what they compete with).

    python -m tierstore.bench.step_profile --case nvme-overlap --model gpt --params 29.5e6
    python -m tierstore.bench.step_profile --case nvme --model linear --params 256e6

The cases and models are `bench optim` / `bench train`'s (_case.py, _harness.py), without their references:
this says where the time of one case goes (compare cases by running them alternately); `bench optim` and
`bench train` give the ratios. Linux only.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import threading
import time

from . import _case, _harness
from ._common import size_arg


def _disk(path: str) -> tuple[int, int, int]:
    """(ms the device holding `path` was busy, bytes read, bytes written) so far, from /proc/diskstats."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            x = line.split()
            if int(x[0]) == major and int(x[1]) == minor:
                return int(x[12]), int(x[5]) * 512, int(x[9]) * 512
    return 0, 0, 0  # not a block device (tmpfs, overlay): no busy time to report


def _thread_cpu() -> dict[str, tuple[float, float]]:
    """(CPU seconds, seconds ready to run but waiting for a core) so far per thread name (Python threads by
    name, numbered pool threads together; threads Python does not know -- torch's OpenMP team -- as "native").
    The wait is 0 where the kernel keeps no schedstat."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                wait = int(f.read().split()[1]) / 1e9  # ns on the run queue
        except (FileNotFoundError, IndexError, ValueError):
            wait = 0.0
        name = names.get(int(tid), "native").rstrip("0123456789_")
        c, w = out.get(name, (0.0, 0.0))
        out[name] = (c + (int(fields[11]) + int(fields[12])) / tick, w + wait)  # utime + stime
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierstore.bench.step_profile", description=__doc__.split("\n")[0])
    p.add_argument("--case", default="nvme-overlap",
                   help=f"one of {', '.join([*_case.TORCH_CASES, *_case.TIERSTORE_CASES])}")
    p.add_argument("--model", choices=("linear", "gpt"), default="gpt")
    p.add_argument("--params", type=float, default=29.5e6)
    p.add_argument("--width", type=int, default=1024, help="linear: width of each layer")
    p.add_argument("--batch", type=int, default=None, help="linear: 16, gpt: 2 sequences")
    p.add_argument("--context", type=int, default=256, help="gpt: tokens per sequence")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one untimed)")
    p.add_argument("--dir", default=".", help="directory on the disk under test")
    p.add_argument("--sub-group", type=size_arg, default=64 << 20)
    p.add_argument("--pinned", type=size_arg, default=64 << 20)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    if a.case not in _case.TORCH_CASES and a.case not in _case.TIERSTORE_CASES:
        p.error(f"--case {a.case!r}: use one of {', '.join([*_case.TORCH_CASES, *_case.TIERSTORE_CASES])}")
    spec = {"model": a.model, "params": a.params, "lr": 1e-3, "threads": a.threads, "sub_group_bytes": a.sub_group,
            "pinned_bytes": a.pinned, "dir": os.path.join(os.path.abspath(a.dir), f"step-profile-{os.getpid()}"),
            "batch": a.batch or (16 if a.model == "linear" else 2)}
    spec.update({"width": a.width} if a.model == "linear" else {"context": a.context})
    os.makedirs(a.dir, exist_ok=True)
    _harness.setup(a.threads)
    import torch
    make, data, loss_fn, _tokens = _harness.build(spec)
    if a.case in _case.TORCH_CASES:
        model = make()
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"],
                                                       **_case.TORCH_CASES[a.case])
        close, wait = (lambda: None), (lambda: None)
    else:
        from .. import zero
        cfg = _case.offload_config(a.case, spec)
        with zero.Init(cfg):
            model = make()
        zopt = zero.Zero3Optimizer(model, torch.optim.AdamW, config=cfg, lr=spec["lr"], fused=True)
        opt, close, wait = zopt, zopt.close, zopt.synchronize  # [Note: a timed step ends when its I/O does] in _case.py
    rows: list[tuple[float, ...]] = []
    cpu: dict[str, list[float]] = {}  # name -> [CPU s, run-queue wait s], summed over the timed steps
    main_wait = []  # the caller's run-queue wait in each timed backward
    me = threading.current_thread().name
    try:
        for i in range(1 + a.steps):
            x, y = data[i % len(data)]
            c0, t0, d0 = _thread_cpu(), time.perf_counter(), _disk(a.dir)
            loss = loss_fn(model, x, y)
            t1, d1, b0 = time.perf_counter(), _disk(a.dir), _thread_cpu()
            loss.backward()
            t2, d2, b1 = time.perf_counter(), _disk(a.dir), _thread_cpu()
            opt.step()
            opt.zero_grad()
            wait()
            t3, d3 = time.perf_counter(), _disk(a.dir)
            if i == 0:
                continue  # the first step builds states and the trace
            rows.append((t1 - t0, t2 - t1, t3 - t2, *((e[0] - s[0]) / 1e3 / (te - ts) for s, e, ts, te in
                                                      ((d0, d1, t0, t1), (d1, d2, t1, t2), (d2, d3, t2, t3))),
                         (d3[1] - d0[1]) / 2**30, (d3[2] - d0[2]) / 2**30))
            main_wait.append(b1[me][1] - b0[me][1])
            for k, (c, w) in _thread_cpu().items():
                got = cpu.setdefault(k, [0.0, 0.0])
                got[0] += c - c0.get(k, (0.0, 0.0))[0]
                got[1] += w - c0.get(k, (0.0, 0.0))[1]
    finally:
        close()
        shutil.rmtree(spec["dir"], ignore_errors=True)
    m = [statistics.median(r[j] for r in rows) for j in range(8)]
    print(f"{a.case} ({a.model}, {a.params / 1e6:.1f}M), medians of {a.steps} steps, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"  seconds     forward {m[0]:.3f}  backward {m[1]:.3f}  step {m[2]:.3f}  full {sum(m[:3]):.3f}")
    print(f"  disk busy   forward {m[3]:.0%}  backward {m[4]:.0%}  step {m[5]:.0%}   "
          f"(device of {a.dir}: {m[6]:.2f} GiB read, {m[7]:.2f} GiB written per step, all processes)")
    print("  CPU s/step  " + "  ".join(f"{k} {v[0] / a.steps:.3f}" for k, v in
                                       sorted(cpu.items(), key=lambda kv: -kv[1][0]) if v[0] > 0))
    print("  waiting for a core, s/step  " + "  ".join(
        f"{k} {v[1] / a.steps:.3f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1][1]) if v[1] > 0.0005)
        + f"   ({me} in backward: {statistics.median(main_wait):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
