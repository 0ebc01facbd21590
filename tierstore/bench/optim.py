"""`tierstore bench optim`: whole training steps of a stack of Linear layers (batch 16), torch AdamW in memory
(fused and foreach) against tierstore's host, nvme and nvme + dynamic8 tiers and DeepSpeed ZeRO-3
(ZeRO-Offload, ZeRO-Infinity; from ./.venv-ds, `make .venv-ds`), each case in its own process, one step each
per round in another order each round, with the raw engine moving the nvme step's bytes in the same rounds.
What each figure means: steps.py and bench/README.md; when a target counts as met: verdict.py.

Targets it prints: host full step <= 1.1x torch's; nvme full step <= 1.15x max(torch's, the raw
engine reading and writing the step's bytes at once); dynamic8 >= 1.5x faster than fp32 on nvme; full step
<= 0.7x DeepSpeed's and peak RSS <= 0.5x (host vs ZeRO-Offload, nvme vs ZeRO-Infinity). Each is "met" or
"MISSED" only where every round's ratio is on one side and the load stayed low; else "undecided (why)".
Sizes used in bench/README.md: `--params 256e6`, `--params 134e6`, `--params 1e9`.
"""
from __future__ import annotations

import argparse

from . import steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    steps.add_arguments(p, "linear")


def run(args) -> int:
    return steps.run(args, "linear", "optim")
