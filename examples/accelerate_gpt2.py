"""accelerate with ZeRO-3 over the store: tierstore.integrations.accelerate.prepare.

    python examples/accelerate_gpt2.py --steps 10 --dir ts-data/accelerate
    torchrun --nproc_per_node 2 examples/accelerate_gpt2.py --steps 10 --dir ts-data/accelerate

Gradient accumulation, clipping and a scheduler through accelerate's usual calls; save_state halfway,
then a fresh model, optimizer and Accelerator load_state and finish; the weights from get_state_dict match.
"""
from __future__ import annotations

import argparse
import os

import torch
from _tiny import tiny_gpt2, token_rows
from accelerate import Accelerator

from tierstore.integrations.accelerate import prepare
from tierstore.zero import OffloadConfig, Zero3Optimizer

ACCUMULATE = 2  # micro-batches per step


def train(a, lo: int, hi: int, *, save: str | None = None, load: str | None = None) -> dict[str, torch.Tensor]:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = tiny_gpt2()
    config = OffloadConfig(params="host", optimizer_states="nvme", gradients="host",
                           nvme_paths=[os.path.join(a.dir, f"nvme-{lo}")])
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01, config=config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.1, 1 - s / a.steps))
    model, opt, sched = prepare(acc, model, opt, sched)
    if load:
        acc.load_state(load)
    rows = token_rows(a.steps * ACCUMULATE * 4).view(-1, 4, 32)  # every rank takes its own micro-batches
    for i in range(lo, hi):
        x = rows[(i * acc.num_processes + acc.process_index) % len(rows)]
        with acc.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 1.0)
                acc.print(f"micro-batch {i + 1}: loss {loss.item():.4f}, grad norm {float(norm):.4f}")
                if not float(norm) > 0:
                    raise SystemExit("clip_grad_norm_ saw no gradient: ZeRO-3's gradients were not reached")
            opt.step()
            sched.step()
            opt.zero_grad()
        if save and i + 1 == save_at(a):
            acc.save_state(save)
    return acc.get_state_dict(model)


def save_at(a) -> int:
    return (a.steps // 2) * ACCUMULATE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dir", default="ts-data/accelerate")
    a = p.parse_args()
    state = os.path.join(a.dir, "state")
    full = train(a, 0, a.steps * ACCUMULATE, save=state)
    resumed = train(a, save_at(a), a.steps * ACCUMULATE, load=state)
    same = all(torch.equal(full[k], resumed[k]) for k in full)
    print(f"get_state_dict: {len(full)} tensors; resumed from save_state equal: {same}")
    if not same:
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
