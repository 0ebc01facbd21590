"""`tierstore bench train`: tokens per second of the demo's GPT family (gpt.py) on byte tokens of the Python
standard library's sources, torch AdamW in memory (fused and foreach) against tierstore's host, nvme and
nvme + dynamic8 tiers (and DeepSpeed ZeRO-3 where ./.venv-ds has it), each case in its own process, one step
each per round in another order each round, with the raw engine moving the nvme step's bytes in the same rounds
(steps.py).

Targets it prints: tokens/s >= 0.95x torch's on the host tier, >= 0.85x on nvme; each "met" or "MISSED" only
where every round's ratio is on one side and the load stayed low, else "undecided (why)" (verdict.py).
"""
from __future__ import annotations

import argparse

from . import steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    steps.add_arguments(p, "gpt")


def run(args) -> int:
    return steps.run(args, "gpt", "train")
