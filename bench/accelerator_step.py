"""A GPT training step with the model on a real accelerator: plain torch (everything in accelerator memory,
AdamW(fused=True)) against Zero3Optimizer with the master and states on the host tier (ZeRO-Offload's
placement; plain and with overlap_step) and everything on the nvme tier (ZeRO-Infinity's), plain, with
overlap_step, and with overlap_step and 8-bit states; tierstore's inner AdamW is fused, as torch's. Run by hand on a
machine with an accelerator ([Note: the accelerator checks] in tests/test_accelerator.py):

    python bench/accelerator_step.py --params 300e6 --rounds 5 --dir /tmp/ts-bench

The cases are built once and then stepped in turn, round after round (A B C D A B C D ...), each step timed
from its first kernel to the end of optimizer.step() with the accelerator synchronised; the table gives each
case's median step and tokens/s relative to torch's in the same run. fp32 parameters with TF32 matmuls for
every case. Prints JSON too (--json FILE).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierstore import gpt  # noqa: E402
from tierstore.bench._case import TIERSTORE_CASES, tier_bytes  # noqa: E402
from tierstore.tiers.device import default_device  # noqa: E402
from tierstore.zero import OffloadConfig, Zero3Optimizer  # noqa: E402

# name -> (params tier, states and gradients tier, overlap_step, state_codec); None: plain torch. The nvme cases
# are bench train's (_case.TIERSTORE_CASES); "host" keeps the parameters on the accelerator, as ZeRO-Offload does.
CASES: dict[str, tuple | None] = {"torch-fused": None, "host": ("device", "host", False, None),
                                   "host-overlap": ("device", "host", True, None)}
CASES.update({name: (tier, tier, overlap, codec) for name, (tier, codec, overlap) in TIERSTORE_CASES.items()
              if name in ("nvme", "nvme-overlap", "nvme8-overlap")})


def gpt_task(params: float, context: int, batch: int):
    """(accelerator, width, layers, loss_of(model, i)) for a GPT of about `params` parameters trained on 4 fixed
    batches of `batch` x `context` tokens, TF32 matmuls on; None where torch sees no accelerator."""
    dev = default_device()
    if dev.type == "cpu":
        return None
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    width, layers = gpt.shape_for(params)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, gpt.VOCAB, (batch, context + 1), generator=g).to(dev) for _ in range(4)]

    def loss_of(model, i):
        d = data[i % len(data)]
        logits = model(d[:, :-1])
        return F.cross_entropy(logits.reshape(-1, gpt.VOCAB), d[:, 1:].reshape(-1))

    return dev, width, layers, loss_of


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=300e6)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default="bench-data/accelerator")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    task = gpt_task(a.params, a.context, a.batch)
    if task is None:
        print("no accelerator: this benchmark is for a machine with one (bench train runs on the CPU)")
        return 2
    dev, width, layers, loss_of = task
    n_params = gpt.count_params(width, layers, a.context)
    tokens = a.batch * a.context

    cases = {}
    for name in a.cases.split(","):
        torch.manual_seed(0)
        model = gpt.build_model(width, layers, a.context).to(dev)
        if CASES[name] is None:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            ptier, tier, overlap, codec = CASES[name]
            cfg = OffloadConfig(params=ptier, optimizer_states=tier, gradients=tier, overlap_step=overlap,
                                state_codec=codec,
                                nvme_paths=[os.path.join(a.dir, name)] if "nvme" in (ptier, tier) else None)
            # fused=True as torch's: the states on the host and nvme tiers step on the CPU, where torch's default
            # is its for-loop ([Note: the inner step's implementation on the CPU] in tierstore/zero/step/stepper.py)
            opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-4, config=cfg, fused=True)
        cases[name] = (model, opt, [], [])
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}; GPT {n_params / 1e6:.0f}M params "
          f"(width {width}, {layers} layers), {tokens} tokens per step; load {os.getloadavg()[0]:.2f}", flush=True)
    start: dict[str, dict] = {}  # bytes moved before the first timed step
    for r in range(a.warmup + a.rounds):
        for name, (model, opt, times, losses) in cases.items():
            if r == a.warmup and isinstance(opt, Zero3Optimizer):
                start[name] = tier_bytes(opt)
            torch.accelerator.synchronize()
            t0 = time.perf_counter()
            loss = loss_of(model, r)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.accelerator.synchronize()
            if r >= a.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    ref = statistics.median(cases["torch-fused"][2]) if "torch-fused" in cases else None
    out = {"device": str(dev), "params": n_params, "tokens_per_step": tokens, "load": os.getloadavg()[0], "cases": {}}
    print(f"{'case':14} {'median step s':>14} {'tokens/s':>10} {'vs torch':>9} {'disk GB/step':>13}  losses")
    for name, (_, opt, times, losses) in cases.items():
        med = statistics.median(times)
        rel = ref / med if ref else float("nan")
        moved = {k: v - start[name].get(k, 0) for k, v in tier_bytes(opt).items()} if name in start else {}
        disk = (moved.get("nvme_read", 0) + moved.get("nvme_written", 0)) / a.rounds  # bytes per timed step
        out["cases"][name] = {"step_s": times, "median_s": med, "tokens_per_s": tokens / med, "vs_torch": rel,
                              "disk_bytes_per_step": disk, "bytes": moved, "losses": losses}
        print(f"{name:14} {med:14.3f} {tokens / med:10.0f} {rel:8.2f}x {disk / 1e9:13.2f}  "
              + " ".join(f"{x:.4f}" for x in losses))
        if hasattr(opt, "close"):
            opt.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
