"""The same Trainer script on one process or N: TierstoreTrainer under torchrun.

    torchrun --standalone --nproc_per_node 2 examples/trainer_ddp.py --steps 20 --dir ts-data/trainer-ddp
    python examples/trainer_ddp.py --steps 20 --dir ts-data/trainer-ddp          # the same script, one process

Each process holds 1/N of the parameters, gradients and optimizer states (ZeRO-3) and reads its own share of
every global batch (Trainer's distributed sampler); nothing in the script names the world size. It trains a
tiny GPT-2 with eval, saves checkpoint-N (model.safetensors + tierstore_optimizer/, which any world size can
resume), resumes from the first checkpoint in a fresh trainer and checks that it ends where the first run ended.
"""
from __future__ import annotations

import argparse
import os

import torch
from _tiny import tiny_gpt2, token_rows
from safetensors.torch import load_file
from transformers import TrainingArguments

from tierstore.integrations.trainer import TierstoreTrainer
from tierstore.zero import OffloadConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dir", default="ts-data/trainer-ddp")
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    data = [{"input_ids": x, "labels": x} for x in token_rows(64)]
    evals = [{"input_ids": x, "labels": x} for x in token_rows(16, seed=1)]
    half = max(1, a.steps // 2)

    def targs(out: str) -> TrainingArguments:
        return TrainingArguments(os.path.join(a.dir, out), max_steps=a.steps, per_device_train_batch_size=4,
                                 learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=half,
                                 eval_strategy="steps", eval_steps=half, save_steps=half, report_to=[],
                                 use_cpu=True, optim="adamw_torch", disable_tqdm=True)

    def config(name: str) -> OffloadConfig:  # each process its own scratch directory
        return OffloadConfig(params="host", optimizer_states="nvme", gradients="host",
                             nvme_paths=[os.path.join(a.dir, f"{name}-rank{rank}")])

    args = targs("run")
    trainer = TierstoreTrainer(model=tiny_gpt2(), args=args, train_dataset=data, eval_dataset=evals,
                               offload_config=config("nvme"))
    trainer.train()
    trainer.save_model(os.path.join(a.dir, "final"))
    world = args.world_size
    if rank == 0:
        losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        print(f"world {world}: trained {a.steps} steps, global batch {4 * world}; eval losses "
              f"{[round(v, 4) for v in losses]}")

    again = TierstoreTrainer(model=tiny_gpt2(), args=targs("resumed-run"), train_dataset=data, eval_dataset=evals,
                             offload_config=config("nvme2"))
    again.train(resume_from_checkpoint=os.path.join(a.dir, "run", f"checkpoint-{half}"))
    again.save_model(os.path.join(a.dir, "resumed"))
    if rank == 0:
        final = load_file(os.path.join(a.dir, "final", "model.safetensors"))
        resumed = load_file(os.path.join(a.dir, "resumed", "model.safetensors"))
        same = all(torch.equal(final[k], resumed[k]) for k in final)
        print(f"world {world}: resumed run equal: {same}")
        if not same:
            raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
