"""`tierstore bench quality`: does training with 8-bit optimizer states end where fp32 states do?

One GPT (tierstore/gpt.py: byte-level, pre-norm, tied head) trained from the same initialisation on the same
batches of the Python standard library's sources, once per optimizer and learning rate; the eval loss on
held-out text (the last tenth, never trained on) every few steps and at the end. Printed: each 8-bit
optimizer's final eval-loss gap to fp32 AdamW in memory at the same learning rate, side by side:

- tierstore dynamic8, fused: Zero3Optimizer(torch.optim.AdamW), states on nvme with state_codec="dynamic8",
  stepped by the fused native 8-bit kernel ([Note: fused 8-bit step in ZeRO-3] in zero/step/state8.py);
- tierstore dynamic8, unfused: the same states through the unpack -> torch AdamW -> pack path (an AdamW
  subclass, which the fused kernel does not claim to compute);
- bitsandbytes AdamW8bit and torchao AdamW8bit, as users would pick them (their defaults), where they import
  ("not installed" otherwise).
Each tierstore row also reports how many of its states were 8-bit and how many sub-group steps were fused, so
a row cannot silently measure the fp32 path. The default, 100 steps, is short and its gaps noisy; `--steps
300` gives the longer run. Plotted (eval loss per step, one panel per learning rate) next to the
JSON.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from ..plot import Panel, Series, png_path, save_png
from ._common import print_table, write_json

FP32 = "torch AdamW fp32"
TS_FUSED = "tierstore dynamic8 (fused)"
TS_UNFUSED = "tierstore dynamic8 (unfused)"
TS_OVERLAP = "tierstore dynamic8 (step overlapping backward)"
BNB = "bitsandbytes AdamW8bit"
TORCHAO = "torchao AdamW8bit"
VARIANTS = (FP32, TS_FUSED, TS_UNFUSED, TS_OVERLAP, BNB, TORCHAO)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=100, help="training steps per run (100; 300 for a longer run)")
    p.add_argument("--lrs", default="1e-3,3e-4", help="comma-separated learning rates (1e-3,3e-4)")
    p.add_argument("--width", type=int, default=128, help="model width, a multiple of 64 (128)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (4)")
    p.add_argument("--context", type=int, default=128, help="bytes per sequence (128)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (8)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation (8)")
    p.add_argument("--evals", type=int, default=5, help="evaluations along the run, the last at the end (5)")
    p.add_argument("--text", default="8M", help="bytes of stdlib source to read (8M)")
    p.add_argument("--dir", default=None, help="directory for the nvme tier (default: a temp dir in .)")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(VARIANTS))


def _reference_optimizer(name: str) -> tuple[Callable | None, str]:
    """(model -> optimizer factory taking lr, '') or (None, why it is missing)."""
    try:
        if name == BNB:
            import bitsandbytes as bnb
            return (lambda m, lr: bnb.optim.AdamW8bit(m.parameters(), lr=lr)), ""
        import torchao.optim
        return (lambda m, lr: torchao.optim.AdamW8bit(m.parameters(), lr=lr)), ""
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return None, f"not installed ({type(e).__name__}: {str(e)[:80]})"


def _train(name: str, lr: float, args, data, root: str) -> dict:
    import torch
    import torch.nn.functional as F

    from ..gpt import build_model
    from ..zero import OffloadConfig, Zero3Optimizer

    torch.manual_seed(0)
    model = build_model(args.width, args.layers, args.context)
    train, evals = data
    zopt = None
    if name == FP32:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    elif name in (TS_FUSED, TS_UNFUSED, TS_OVERLAP):
        cls = torch.optim.AdamW
        if name == TS_UNFUSED:
            class AdamW(torch.optim.AdamW):  # the same update; not torch.optim.AdamW itself, so never fused
                pass
            cls = AdamW
        d = os.path.join(root, f"{len(os.listdir(root))}")
        cfg = OffloadConfig(params="host", optimizer_states="nvme", gradients="host", nvme_paths=[d],
                            state_codec="dynamic8", overlap_step=name == TS_OVERLAP)
        opt = zopt = Zero3Optimizer(model, cls, lr=lr, config=cfg, elementwise_ok=True)
    else:
        make, why = _reference_optimizer(name)
        if make is None:
            return {"skipped": why}
        opt = make(model, lr)

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            tot = sum(float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in evals)
        model.train()
        return tot / len(evals)

    every = max(1, args.steps // max(1, args.evals))
    curve: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    try:
        for i, (x, y) in enumerate(train, start=1):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i % every == 0 or i == len(train):
                curve.append((i, eval_loss()))
        out = {"eval_loss": curve[-1][1], "train_loss": loss.item(), "curve": curve,
               "seconds": time.perf_counter() - t0}
        if zopt is not None:
            st = zopt.stats()
            out.update(quantized_states=st.quantized_states, fused_steps=st.fused_steps, overlapped=st.overlapped)
            if st.quantized_states == 0 or (name == TS_FUSED and st.fused_steps == 0) or \
                    (name == TS_UNFUSED and st.fused_steps > 0) or (name == TS_OVERLAP and st.overlapped == 0):
                raise RuntimeError(f"{name}: {st.quantized_states} 8-bit states, {st.fused_steps} fused steps, "
                                   f"{st.overlapped} overlapped -- "
                                   f"this row would not measure what it names")
        return out
    finally:
        if zopt is not None:
            zopt.close()


def run(args) -> int:
    import torch

    from ..gpt import batches, stdlib_text
    from ._common import parse_size

    if args.width % 64 or args.steps < 1 or args.evals < 1:
        raise SystemExit("bench quality: --width must be a multiple of 64, --steps and --evals >= 1")
    lrs = [float(x) for x in args.lrs.split(",")]
    names = list(VARIANTS)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        bad = [n for n in names if n not in VARIANTS]
        if bad:
            raise SystemExit(f"bench quality --only: unknown {bad}; choose from {list(VARIANTS)}")
        if FP32 not in names:
            names.insert(0, FP32)  # the gaps are to it
    text, files, where = stdlib_text(parse_size(args.text))
    cut = len(text) * 9 // 10
    train = batches(text[:cut], args.steps, args.batch, args.context, seed=1)
    evals = batches(text[cut:], args.eval_batches, args.batch, args.context, seed=2)
    print(f"bench quality: {len(text) / 2**20:.1f} MiB of {files} stdlib files ({where}), model width "
          f"{args.width} x {args.layers} layers, {args.steps} steps of {args.batch} x {args.context} bytes, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    root = tempfile.mkdtemp(prefix="bench-quality-", dir=args.dir or ".")
    results: dict[str, dict[str, dict]] = {}
    nthreads = torch.get_num_threads()
    try:
        for lr in lrs:
            for n in names:
                r = results.setdefault(f"{lr:g}", {})[n] = _train(n, lr, args, (train, evals), root)
                print(f"  lr {lr:g}: {n}: " + (f"eval loss {r['eval_loss']:.4f} ({r['seconds']:.0f} s)" if
                                                "eval_loss" in r else r["skipped"]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        torch.set_num_threads(nthreads)
    rows = []
    for n in names:
        row = [n]
        for lr in lrs:
            r, ref = results[f"{lr:g}"][n], results[f"{lr:g}"][FP32]
            if "skipped" in r:
                row += [r["skipped"].split(" (")[0], "-"]
                continue
            r["gap_pct"] = 100 * (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
            row += [f"{r['eval_loss']:.4f}", "reference" if n == FP32 else f"{r['gap_pct']:+.3f}%"]
        rows.append(row)
    cols = ["optimizer"] + [c for lr in lrs for c in (f"eval loss, lr {lr:g}", f"gap to fp32, lr {lr:g}")]
    print_table(f"8-bit optimizer states vs fp32 after {args.steps} steps (eval loss on held-out stdlib text)",
                cols, rows, caption="gap = (eval loss - fp32's) / fp32's, same model, data and initialisation; "
                                    "a short run's gaps are noise-sized (--steps 300 for a longer run)")
    write_json(args.json, {"bench": "quality", "steps": args.steps, "lrs": lrs, "width": args.width,
                           "layers": args.layers, "context": args.context, "batch": args.batch,
                           "load_average": os.getloadavg()[0], "results": results})
    panels = [Panel(f"lr {lr:g}", "eval loss", [Series(n, [s for s, _ in r["curve"]], [v for _, v in r["curve"]],
                                                          "o-") for n, r in results[f"{lr:g}"].items()
                                                 if "curve" in r], xlabel="step")
              for lr in lrs]
    print(save_png(png_path(args.json, None), "8-bit optimizer states vs fp32: eval loss", panels))
    bad = [n for lr in lrs for n, r in results[f"{lr:g}"].items() if "eval_loss" in r and
           not math.isfinite(r["eval_loss"])]
    if bad:
        print(f"bench quality: non-finite eval loss for {bad}")
        return 1
    return 0
