"""The `tierstore` command: `tierstore info`, `tierstore demo`, `tierstore tune DIR` and `tierstore bench <name>`.

Each benchmark is a module ``tierstore.bench.<name>`` with ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when asked for, so one benchmark's optional references never slow another. `tune` is
``tierstore.io.tune`` (it belongs to the I/O layer, not to the benchmarks), `demo` ``tierstore.demo``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

BENCHMARKS = {
    "quant": "block quantizers (int8/int4/dynamic 8-bit) and the 8-bit AdamW step vs bitsandbytes and torch",
    "io": "sequential, random 4 KiB (IOPS, p50/p99 latency), mixed and small-request I/O, CPU s/GiB, the memory "
          "paths (plain tensor, put, get) vs fio and DeepSpeed aio",
    "store": "Store put+flush/get of many small and a few large tensors vs the raw engine and torch.save/load",
    "partition": "layout of GPT-2/7B shapes: I/O requests per rank, their size, padding vs one file per parameter",
    "optim": "training steps of a Linear stack: torch AdamW in memory vs host / NVMe / NVMe+8-bit tiers vs DeepSpeed "
             "ZeRO-3 (Offload, Infinity), the raw engine on the same bytes, peak RSS",
    "train": "tokens/s of a GPT: torch AdamW in memory vs host / NVMe / NVMe+8-bit tiers, the raw engine, peak RSS",
    "hpz": "bytes of ZeRO-3's all-gathers inside and across simulated nodes per step, without and with hpZ / qwZ",
    "activations": "a GPT step with long sequences: peak RSS and time, torch plain / checkpointed vs activation "
                   "offload to host / NVMe",
    "quality": "eval-loss gap to fp32 AdamW of tierstore's 8-bit states (fused, unfused), bitsandbytes and torchao",
    "scale": "one GPT family from 64M to 1B parameters on NVMe: peak RSS, bytes on disk, step time per parameter",
    "inference": "greedy generation tokens/s and peak RSS: the model in memory vs accelerate's disk_offload vs "
                 "offload_for_inference on host / NVMe (fp32, bf16, int8), bytes read per token, perplexity",
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__.splitlines()[0])
    from . import __version__
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="what this machine offers: io_uring, O_DIRECT, page-lock limit, torch")
    info.add_argument("--dir", default=".", help="directory to probe for O_DIRECT (default: .)")
    _add_common(info)
    demo = sub.add_parser("demo", help="train a GPT on the Python stdlib's sources with everything on the NVMe tier "
                                       "and a memory budget smaller than its states (--big: states > RAM)")
    _add_common(demo)
    importlib.import_module("tierstore.demo").add_arguments(demo)
    tune = sub.add_parser("tune", help="sweep the I/O engine's knobs on a disk in minutes and write the "
                                       "configuration it recommends (Engine.from_tuning / Store(io_tuning=))")
    _add_common(tune)
    importlib.import_module("tierstore.io.tune").add_arguments(tune)
    bench = sub.add_parser("bench", help="benchmarks that print ratios against references run alongside")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, help_ in BENCHMARKS.items():
        p = bsub.add_parser(name, help=help_, description=help_)
        _add_common(p)
        _load(name).add_arguments(p)
    return parser


def _load(name: str):
    return importlib.import_module(f"tierstore.bench.{name}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(name)s: %(message)s")
    if args.command == "info":
        from .info import run_info
        return run_info(args)
    if args.command == "demo":
        return importlib.import_module("tierstore.demo").run(args)
    if args.command == "tune":
        return importlib.import_module("tierstore.io.tune").run(args)
    if isinstance(getattr(args, "dir", None), str):  # the directory a benchmark works in: made if missing
        os.makedirs(args.dir, exist_ok=True)
    return _load(args.bench).run(args)


if __name__ == "__main__":
    sys.exit(main())
