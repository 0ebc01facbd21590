"""`tierstore bench inference`: greedy generation from a GPT-2 (byte tokens, trained briefly on the Python
standard library's sources so its weights are not random) with its weights in memory, under accelerate's
disk_offload, and on tierstore's host and nvme tiers (fp32, bf16, int8 at rest), each case in its own process
(_infer_case.py), alternated A B A B; the raw engine reads the fp32 weights once in the same rounds.

Every case that keeps its weights on the disk (accelerate, the nvme tier) runs under the same memory limit, a
cgroup of its own, so the page cache cannot hold the model for one of them and not the others ([Note: equal
memory for every case] in _memlimit.py); the limit is printed with what it is made of (the processes' baseline,
the tierstore budget, its staging buffers, headroom for activations). The model in memory and the host tier
hold the whole model in RAM by design and run without a limit.

Printed per case: tokens/s and its ratio to the model in memory and to accelerate's disk offload, seconds per
token against the raw engine's time to read the weights once, peak RSS while generating and, under the limit,
the cgroup's peak (RSS and page cache), the kernel's bytes read per token (/proc/self/io read_bytes: page-cache
hits are not counted), the time per token the reading threads spent turning bf16 / int8 weights back into fp32,
and the perplexity on held-out text against the fp32 model's. The load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys

from ._common import fmt_bytes, print_table, size_arg, write_json
from ._infer_case import CASES, TIERSTORE_CASES
from ._memlimit import MemoryGroup, drop_files

CONTEXT = 128  # bytes per training and perplexity window


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="./bench-inference", help="directory on the disk under test (weights of the "
                                                              "nvme cases and accelerate's memmaps go here)")
    p.add_argument("--params", type=float, default=16e6, help="parameters of the model (default 16e6; the demo's "
                                                             "GPT family shapes: 4 layers below ~50M, then 1024 wide)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per timed step (default 16)")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per case, alternated A B A B (default 3)")
    p.add_argument("--budget", type=size_arg, default=None,
                   help="budget_bytes of the tierstore cases (default: a quarter of the fp32 weights, at most "
                        "128 MiB, at least four of the largest Linear's weights)")
    p.add_argument("--mem-limit", type=size_arg, default=None,
                   help="memory limit (RSS + page cache) of every case keeping its weights on the disk (default: "
                        "the largest baseline RSS of those processes + the budget + the store's staging + 64 MiB)")
    p.add_argument("--train-steps", type=int, default=30, help="AdamW steps on stdlib text before the run, so the "
                                                               "perplexity means something (default 30)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--ppl-windows", type=int, default=8, help="windows of 128 bytes the perplexity is taken "
                                                               "over (default 8)")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="torch threads per case")


def _prepare(args, root: str, cases: list[str]) -> tuple[str, int, int]:
    """Build, train briefly and save the model (and accelerate's memmaps of it): (its directory, parameters,
    bytes of the largest Linear)."""
    import torch
    import transformers

    from ..gpt import HEAD, VOCAB, batches, shape_for, stdlib_text
    transformers.logging.set_verbosity_error()
    width, layers = shape_for(args.params)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=width // HEAD,
                                     n_positions=max(CONTEXT, 64 + args.tokens + 8), bos_token_id=None,
                                     eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    text = stdlib_text(1 << 20)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, _y in batches(text[:len(text) // 2], args.train_steps, 8, CONTEXT):
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(root, "model")
    model.save_pretrained(path)
    if "accelerate" in cases:  # its memmaps, written once here: the case's process maps them, loading nothing
        from accelerate.utils import offload_state_dict
        offload_state_dict(os.path.join(root, "accelerate-weights"), model.state_dict())
    nparams = sum(p.numel() for p in model.parameters())
    return path, nparams, 16 * width * width  # bytes of the largest Linear (the MLP's, 4 x width^2 in fp32)


def default_budget(weight_bytes: int, linear_bytes: int) -> int:
    """The tierstore cases' budget_bytes: a quarter of the fp32 weights, at most 128 MiB, at least four of the
    largest Linear's weights. On this machine's disk half of that (four Linears at 300M) read a third slower per
    token: the reads in flight it leaves do not keep the disk busy (docs/inference.md)."""
    return max(min(weight_bytes // 4, 128 << 20), 4 * linear_bytes)


def limited(case: str) -> bool:
    """Whether `case` keeps its weights on the disk (and so runs under the memory limit)."""
    return case == "accelerate" or TIERSTORE_CASES.get(case, ("", None))[0] == "nvme"


def run(args) -> int:
    from ..zero.inference.offload import staging_bytes
    from .steps import RawEngine, Worker

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"--cases: {bad} unknown; choose from {','.join(CASES)}")
    root = os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    load0 = os.getloadavg()
    print(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start; preparing the model "
          f"({args.params / 1e6:.0f}M parameters, {args.train_steps} training steps) ...", flush=True)
    model_dir, nparams, linear_bytes = _prepare(args, root, cases)
    weight_bytes = nparams * 4
    budget = args.budget or default_budget(weight_bytes, linear_bytes)
    spec = {"model_dir": model_dir, "dir": root, "threads": args.threads, "budget": budget, "tokens": args.tokens,
            "prompt": 64, "context": CONTEXT, "ppl_windows": args.ppl_windows, "text_bytes": 1 << 20,
            "acc_dir": os.path.join(root, "accelerate-weights")}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    workers: dict[str, Worker] = {}
    groups: dict[str, MemoryGroup] = {}
    ready: dict[str, dict] = {}
    samples: dict[str, list[dict]] = {c: [] for c in cases}
    raw: list[float] = []
    final: dict[str, dict] = {}
    why_not = ""
    eng = RawEngine(root, weight_bytes, 0)
    try:
        for c in cases:  # one at a time: loading is not what is measured
            print(f"loading case {c} ...", flush=True)
            w = Worker(c, [sys.executable, "-m", "tierstore.bench._infer_case", json.dumps({**spec, "case": c})],
                       env, os.path.join(root, f"{c}.log"))
            workers[c] = w
            if limited(c) and not why_not:
                g, why_not = MemoryGroup.create(c)
                if g is not None:
                    groups[c] = g
                    g.add(w.proc.pid)  # at once: what it allocates from here on is charged to its group
            ready[c] = w.ask(None, 1800)
        base = max((ready[c]["rss_base"] for c in cases if limited(c)), default=0)
        limit = args.mem_limit or base + budget + staging_bytes(budget) + (64 << 20)
        mode = _apply_limit(cases, groups, why_not, limit, root, base, budget, args.mem_limit is not None)
        print(mode, flush=True)
        for _ in range(args.rounds):
            for c in cases:
                if limited(c) and c not in groups:
                    drop_files(root)  # the fallback: no page of the weights cached when the round starts
                samples[c].append(workers[c].ask("step", 1800))
            raw.append(eng.read())
        for c in cases:
            if c in groups:
                ready[c]["cgroup_peak"] = groups[c].peak()
            final[c] = workers[c].finish(600)
    finally:
        for w in workers.values():
            w.kill()
        for g in groups.values():
            g.close()
        eng.close()
    load1 = os.getloadavg()
    result = _summarize(cases, samples, ready, final, raw, args.tokens)
    _print(result, args, nparams, weight_bytes, budget, load0, load1, mode)
    write_json(args.json, {"params": nparams, "weight_bytes": weight_bytes, "budget": budget, "tokens": args.tokens,
                           "rounds": args.rounds, "load_start": load0, "load_end": load1, "cases": result,
                           "raw_read_s": raw, "memory_limit": limit if groups else None, "memory_mode": mode})
    shutil.rmtree(model_dir, ignore_errors=True)  # a run that finished leaves nothing behind (a failed one: logs)
    shutil.rmtree(spec["acc_dir"], ignore_errors=True)
    for c in cases:
        shutil.rmtree(os.path.join(root, c), ignore_errors=True)
        os.unlink(os.path.join(root, f"{c}.log"))
    for f in ("raw-read.bin", "raw-write.bin"):
        if os.path.exists(os.path.join(root, f)):
            os.unlink(os.path.join(root, f))
    return 0


def _apply_limit(cases, groups, why_not, limit, root, base, budget, given=False) -> str:
    """Drop the files' cached pages, set the limit on every group; the line saying how memory was made equal."""
    from ..zero.inference.offload import staging_bytes
    drop_files(root)  # pages cached while preparing are charged to this process: the cases must read them anew
    on = [c for c in cases if limited(c)]
    if not on:
        return "memory: no case keeps its weights on the disk; no limit"
    if not groups:
        return (f"memory: NO LIMIT ({why_not}); instead the files' pages are dropped from the page cache before "
                f"each round of {', '.join(on)} -- within a round a model that fits in memory is read from the "
                f"page cache after its first token")
    for c in on:
        err = groups[c].limit(limit)
        if err:
            raise SystemExit(f"case {c}: {err}; pass a larger --mem-limit")
        groups[c].reset_peak()
    what = "--mem-limit" if given else (f"baseline RSS {fmt_bytes(base)} + budget {fmt_bytes(budget)} + staging "
                                        f"{fmt_bytes(staging_bytes(budget))} + 64 MiB headroom")
    return (f"memory: {', '.join(on)} each in a cgroup limited to {fmt_bytes(limit)} (RSS + page cache) = {what}; "
            f"the others hold the model in RAM and run without a limit")


def _summarize(cases, samples, ready, final, raw, tokens) -> dict[str, dict]:
    out: dict[str, dict] = {}
    raw_s = statistics.median(raw) if raw else float("nan")
    for c in cases:
        s = [x["s"] for x in samples[c]]
        med = statistics.median(s)
        out[c] = {"tokens_s": tokens / med, "s_per_token": med / tokens, "per_token_vs_raw_read": med / tokens / raw_s,
                  "read_per_token": statistics.median(x["read"] for x in samples[c]) / tokens,
                  "peak_rss": final[c]["peak_rss"], "rss_loaded": ready[c]["rss_loaded"], "ppl": ready[c]["ppl"],
                  "cgroup_peak": ready[c].get("cgroup_peak"), "rss_base": ready[c].get("rss_base"),
                  "convert_per_token": final[c]["convert_s"] / final[c]["forwards"] if final[c].get("forwards")
                  else None,
                  "load_s": ready[c]["load_s"], "stored_bytes": final[c].get("stored_bytes"),
                  "peak_weights": final[c].get("peak_weights"), "tokens_out": final[c].get("tokens_out"),
                  "seconds": s}
    ref = out.get("memory")
    for c in cases:
        out[c]["same_tokens_as_memory"] = None if ref is None else out[c]["tokens_out"] == ref["tokens_out"]
    out["_raw_read_s"] = {"median": raw_s}
    return out


def _x(a, b) -> str:
    return "-" if a is None or b is None or not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def _print(result, args, nparams, weight_bytes, budget, load0, load1, mode) -> None:
    cases = [c for c in result if not c.startswith("_")]
    mem, acc = result.get("memory"), result.get("accelerate")
    fp32_ppl = (result.get("memory") or result.get("nvme-fp32") or result.get("host-fp32") or {}).get("ppl")
    rows = []
    for c in cases:
        r = result[c]
        rows.append([c, f"{r['tokens_s']:.2f}", _x(r["tokens_s"], mem and mem["tokens_s"]),
                     _x(r["tokens_s"], acc and acc["tokens_s"]), f"{r['per_token_vs_raw_read']:.2f}x",
                     fmt_bytes(r["peak_rss"]), fmt_bytes(r["cgroup_peak"]) if r["cgroup_peak"] else "no limit",
                     fmt_bytes(int(r["read_per_token"])),
                     "-" if r["convert_per_token"] is None else f"{r['convert_per_token'] * 1e3:.0f} ms",
                     f"{r['ppl']:.3f}", _x(r["ppl"], fp32_ppl),
                     {True: "yes", False: "NO", None: "-"}[r["same_tokens_as_memory"]]])
    raw_s = result["_raw_read_s"]["median"]
    print_table(f"bench inference: GPT-2 {nparams / 1e6:.1f}M parameters ({fmt_bytes(weight_bytes)} fp32), "
                f"{args.tokens} tokens x {args.rounds} rounds, tierstore budget {fmt_bytes(budget)}",
                ["case", "tokens/s", "vs memory", "vs accelerate", "s/token vs raw read", "peak RSS (generate)",
                 "peak cgroup (RSS+cache)", "disk read/token", "convert/token", "perplexity", "vs fp32",
                 "same tokens"], rows,
                caption=f"{mode}\nraw engine reads the fp32 weights once in {raw_s * 1e3:.1f} ms (median); load "
                        f"average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end; {os.cpu_count()} CPUs; "
                        f"denormals flushed to zero in every case (torch.set_flush_denormal)")
