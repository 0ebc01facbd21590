"""`tierstore bench quant`: block quantizers on 16M-element tensors, next to bitsandbytes' CPU
quantize_blockwise when it is installed (same run, A B A B), and the 8-bit AdamW step vs torch's fused AdamW.

Prints, per data set (normal, Student-t df=3), scheme and block size: quantize / dequantize / round-trip
throughput as a ratio to the reference measured alongside (bitsandbytes dynamic 8-bit at the same block size,
or, without it, torch's copy_ of the same tensor), and the error: mean abs, max abs and relative RMS.
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=16 << 20, help="elements per tensor (default 16M)")
    p.add_argument("--blocks", default="256,4096", help="block sizes, comma-separated (default 256,4096)")
    p.add_argument("--schemes", default="", help="schemes, comma-separated (default: every registered scheme)")
    p.add_argument("--rounds", type=int, default=5, help="A B A B rounds per case (default 5)")
    p.add_argument("--no-step", action="store_true", help="skip the 8-bit AdamW step comparison")
    p.add_argument("--step-only", action="store_true", help="only the 8-bit AdamW step comparison")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads, which the native kernels follow (default: torch's default); 1 "
                        "takes OpenMP oversubscription on a loaded machine out of the comparison")
    p.add_argument("--no-torch-reference", action="store_true",
                   help="skip the pure-torch (vectorised, no C) quantizer rows")


def _whole(fn: Callable[..., object], *args, **kwargs) -> Callable[[], None]:
    """A case timed whole (it returns None): fn(*args, **kwargs), the arguments bound now."""
    def case() -> None:
        fn(*args, **kwargs)
    return case


def run(args) -> int:
    import torch

    from tierstore.bench._common import Progress, interleave, print_table, ratio, write_json

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from tierstore.quant import SCHEMES, dequantize, empty_quantized, quantize
    from tierstore.quant.schemes import get

    bnbf: Any  # bitsandbytes.functional where it imports: an optional reference, never a dependency
    try:  # by name, so the types check the same with and without it installed
        bnbf = importlib.import_module("bitsandbytes.functional")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        bnbf = None
    n = args.numel
    blocks = [int(b) for b in args.blocks.split(",")]
    schemes = [get(s).name for s in args.schemes.split(",")] if args.schemes else list(SCHEMES)
    g = torch.Generator().manual_seed(0)
    data = {"normal": torch.randn(n, generator=g),
            "student-t3": torch.distributions.StudentT(3.0).sample((n,))}
    nbytes = n * 4  # bytes of fp32 input
    rows, payload = [], {"numel": n, "cases": []}

    def err(x, y):
        d = (y - x).abs()
        return float(d.mean()), float(d.max()), float((y - x).norm() / x.norm())

    total = len(data) * len(blocks) * len(schemes) * args.rounds
    with Progress(total, "quant") as prog:
        for dname, x0 in ({} if args.step_only else data).items():
            for bs in blocks:
                cases: dict[str, Callable[[], float | None]] = {}
                stats: dict[str, tuple[float, float, float]] = {}
                out = torch.empty(n)
                if bnbf is not None:
                    c, stt = bnbf.quantize_blockwise(x0, blocksize=bs)
                    cases["bnb q"] = _whole(bnbf.quantize_blockwise, x0, blocksize=bs)
                    cases["bnb dq"] = _whole(bnbf.dequantize_blockwise, c, stt)
                    stats["bnb dyn8"] = err(x0, bnbf.dequantize_blockwise(c, stt))
                else:
                    cases["copy"] = _whole(out.copy_, x0)
                for s in schemes:
                    x = x0 if SCHEMES[s].signed else x0.abs()  # an unsigned scheme gets |x|
                    q = empty_quantized(n, s, bs)
                    quantize(x, s, bs, out=q)
                    cases[f"{s} q"] = _whole(quantize, x, s, bs, out=q)
                    cases[f"{s} dq"] = _whole(dequantize, q, out=out)
                    stats[s] = err(x, dequantize(q))
                    if not args.no_torch_reference and s == "dyn8s" and bs == blocks[0]:
                        qt = empty_quantized(n, s, bs)
                        cases["dyn8s (torch ref) q"] = _whole(quantize, x, "dyn8s", bs, out=qt, backend="torch")
                        cases["dyn8s (torch ref) dq"] = _whole(dequantize, qt, out=out, backend="torch")
                        quantize(x, "dyn8s", bs, out=qt, backend="torch")
                prog.describe(f"{dname} block {bs}")
                res = interleave(cases, args.rounds, prog)
                med = {k: v.median for k, v in res.items()}
                ref_rt = (med["bnb q"] + med["bnb dq"]) if bnbf is not None else 2 * med["copy"]
                ref_name = "bnb dyn8" if bnbf is not None else "2x copy_"
                names = (["bnb dyn8"] if bnbf is not None else []) + schemes + (
                    ["dyn8s (torch ref)"] if "dyn8s (torch ref) q" in med else [])
                for name in names:
                    key = name if name != "bnb dyn8" else "bnb"
                    tq, tdq = med.get(f"{key} q"), med.get(f"{key} dq")
                    if tq is None or tdq is None:  # (the q and dq cases are added together)
                        continue
                    rt = tq + tdq
                    e = stats[name] if name in stats else stats.get(name.split(" ")[0], (float("nan"),) * 3)
                    rows.append([dname, bs, name, f"{tq * 1e3:.1f}", f"{tdq * 1e3:.1f}",
                                 f"{nbytes / rt / 1e9:.2f}", ratio(1 / rt, 1 / ref_rt), f"{e[0]:.3g}", f"{e[1]:.3g}",
                                 f"{e[2]:.3g}"])
                    payload["cases"].append(dict(data=dname, block=bs, scheme=name, q_s=tq, dq_s=tdq,
                                                 rt_vs_ref=ref_rt / rt, ref=ref_name, mean_abs=e[0], max_abs=e[1],
                                                 rel_rms=e[2]))
    if not args.step_only:
        ref_what = "bitsandbytes dynamic 8-bit, same block" if bnbf else "2 x torch copy_ (bitsandbytes not installed)"
        print_table(f"block quantizers, {n} fp32 elements (median of {args.rounds} A B A B rounds)",
                    ["data", "block", "scheme", "q ms", "dq ms", "rt GB/s", "rt vs ref", "mean abs", "max abs",
                     "rel RMS"], rows,
                    caption=f"ref = {ref_what}; ms are context, the ratio is the result")
    if not args.no_step:
        # [Note: fused 8-bit step] (quant/states.py): the fused native step, the reference path it replaces
        # (dequantize -> torch's fused AdamW -> requantize, reused buffers) and torch's fused fp32 AdamW, A B A B
        from tierstore.quant.states import AdamW8bit

        grad = torch.randn(n, generator=g)
        params = {name: torch.nn.Parameter(torch.randn(n, generator=g)) for name in ("fp32", "fused", "ref")}
        for prm in params.values():
            prm.grad = grad
        opts = {"torch fused AdamW (fp32 states)": torch.optim.AdamW([params["fp32"]], lr=1e-3, fused=True),
                "8-bit states, fused kernel": AdamW8bit([params["fused"]], lr=1e-3),
                "8-bit states, reference path": AdamW8bit([params["ref"]], lr=1e-3, backend="torch")}
        for o in opts.values():
            o.step()  # first step allocates the states: not timed
        res = interleave({k: o.step for k, o in opts.items()}, args.rounds)
        names = list(opts)
        tf = res[names[0]].median
        rows = []
        for k in names:
            per_round = sorted(b / a for a, b in zip(res[names[0]].seconds, res[k].seconds))
            rows.append([k, f"{res[k].median * 1e3:.1f}", f"{res[k].median / tf:.2f}x",
                         f"{per_round[0]:.2f}-{per_round[-1]:.2f}x"])
        print_table(f"one AdamW step, {n} parameters, {torch.get_num_threads()} thread(s) (median of {args.rounds} "
                    f"A B C rounds)",
                    ["step", "ms", "time vs fused fp32", "per-round range"], rows,
                    caption="target: 8-bit step <= 3x torch's fused fp32 step; state bytes 2 per parameter vs 8")
        payload["step"] = {k: res[k].seconds for k in names}
        payload["step"]["ratio_fused"] = res[names[1]].median / tf
        payload["step"]["ratio_reference"] = res[names[2]].median / tf
    write_json(args.json, payload)
    return 0
