"""The `tierstore` command: `tierstore info`, `tierstore demo` and `tierstore bench <name>`.

Each benchmark is a module ``tierstore.bench.<name>`` with ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when asked for, so one benchmark's optional references never slow another.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

BENCHMARKS = {
    "quant": "block quantizers (int8/int4/dynamic 8-bit) and the 8-bit AdamW step vs bitsandbytes and torch",
    "io": "sequential and small-request I/O vs fio and DeepSpeed aio",
    "store": "Store put+flush/get of many small and a few large tensors vs the raw engine and torch.save/load",
    "partition": "layout of GPT-2/7B shapes: I/O requests per rank, their size, padding vs one file per parameter",
    "optim": "Zero3Optimizer step on host / NVMe / NVMe+8-bit vs fused torch AdamW, the raw disk and the compute",
    "quality": "eval-loss gap to fp32 AdamW of tierstore's 8-bit states (fused, unfused), bitsandbytes and torchao",
    "scale": "one GPT family from 64M to 1B parameters on NVMe: peak RSS, bytes on disk, step time per parameter",
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="what this machine offers: io_uring, O_DIRECT, page-lock limit, torch")
    info.add_argument("--dir", default=".", help="directory to probe for O_DIRECT (default: .)")
    _add_common(info)
    demo = sub.add_parser("demo", help="train a GPT on the Python stdlib's sources with everything on the NVMe tier "
                                       "and a memory budget smaller than its states (--big: states > RAM)")
    _add_common(demo)
    importlib.import_module("tierstore.demo").add_arguments(demo)
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
    return _load(args.bench).run(args)


if __name__ == "__main__":
    sys.exit(main())
