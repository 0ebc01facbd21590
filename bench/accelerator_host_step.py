"""Where the host tier's step goes with the model on an accelerator, and the two places it could run. Run by
hand on a machine with an accelerator ([Note: the inner step's implementation on the CPU] in
tierstore/zero/step/stepper.py; figures in bench/README.md, "Accelerator checks"):

    python bench/accelerator_host_step.py --params 300e6

1. A GPT (bench/accelerator_step.py's) trained with torch AdamW(fused=True) in accelerator memory, then with
   Zero3Optimizer, master, states and gradients on the host tier, AdamW with torch's default implementation
   and with fused=True: forward, backward and step seconds (medians), and torch.profiler's top operators of
   the default one.
2. In plain torch, the step of as many fp32 elements with the states in pinned host memory, done where they
   are (gradients down, AdamW(fused=True) on the CPU, parameters up) or on the accelerator (master and states
   up in 64 MiB pieces on a side stream, fused AdamW there, back down on another), alternated.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerator_step import gpt_task  # noqa: E402

from tierstore import gpt  # noqa: E402
from tierstore.zero import OffloadConfig, Zero3Optimizer  # noqa: E402

PIECE = 16 << 20  # elements per piece of the accelerator-side step (64 MiB of fp32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=300e6)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per case (after one untimed)")
    a = ap.parse_args()
    ctx = 1024
    task = gpt_task(a.params, ctx, 8)
    if task is None:
        print("no accelerator: this benchmark is for a machine with one")
        return 2
    dev, width, layers, loss_of = task

    def phases(name, make_opt, profile=False):
        torch.manual_seed(0)
        model = gpt.build_model(width, layers, ctx).to(dev)
        opt = make_opt(model)
        rows = []
        for i in range(1 + a.steps):
            sync = torch.accelerator.synchronize
            sync()
            t0 = time.perf_counter()
            loss = loss_of(model, i)
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if i:  # the first step builds the states
                rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        m = [statistics.median(r[j] for r in rows) for j in range(3)]
        print(f"{name:36} forward {m[0]:.3f}  backward {m[1]:.3f}  step {m[2]:.3f}  full {sum(m):.3f} s", flush=True)
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler
            with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for i in range(2):
                    loss_of(model, i).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                torch.accelerator.synchronize()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
        if hasattr(opt, "close"):
            opt.close()
        return sum(p.numel() for p in model.parameters())

    host = OffloadConfig(params="device", optimizer_states="host", gradients="host")
    n = phases("torch AdamW(fused) in memory", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True))
    phases("host tier, AdamW default", lambda m: Zero3Optimizer(m, torch.optim.AdamW, lr=1e-4, config=host),
           profile=True)
    phases("host tier, AdamW(fused=True)",
           lambda m: Zero3Optimizer(m, torch.optim.AdamW, lr=1e-4, config=host, fused=True))

    master, m1, m2, grad_h = (torch.zeros(n, pin_memory=True) for _ in range(4))
    grad, params = torch.randn(n, device=dev) * 1e-3, torch.randn(n, device=dev)
    leaf = torch.nn.Parameter(master)
    cpu_opt = torch.optim.AdamW([leaf], lr=1e-4, fused=True)
    step_t = torch.tensor(1.0, device=dev)

    def on_cpu():
        grad_h.copy_(grad, non_blocking=True)
        torch.accelerator.synchronize()
        leaf.grad = grad_h
        cpu_opt.step()
        params.copy_(master, non_blocking=True)
        torch.accelerator.synchronize()

    def on_device():
        up, down = torch.Stream(dev), torch.Stream(dev)
        main = torch.accelerator.current_stream()
        for s in range(0, n, PIECE):
            k = min(PIECE, n - s)
            with up:
                got = [t[s:s + k].to(dev, non_blocking=True) for t in (master, m1, m2)]
            main.wait_stream(up)
            torch._fused_adamw_([got[0]], [grad[s:s + k]], [got[1]], [got[2]], [], [step_t], lr=1e-4, beta1=0.9,
                                beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
            params[s:s + k].copy_(got[0], non_blocking=True)
            down.wait_stream(main)
            with down:
                for h, d in zip((master, m1, m2), got):
                    h[s:s + k].copy_(d, non_blocking=True)
                    d.record_stream(down)
        torch.accelerator.synchronize()

    times: dict[str, list[float]] = {"on the CPU": [], "on the accelerator": []}
    for _ in range(4):
        for name, fn in (("on the CPU", on_cpu), ("on the accelerator", on_device)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():  # the first round warms both up
        print(f"step of {n / 1e6:.0f}M fp32 elements, states in pinned host memory, {name}: median "
              f"{statistics.median(ts[1:]):.3f} s (CPU threads {torch.get_num_threads()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
