"""transformers' Trainer with ZeRO-3 states on the nvme tier: TierstoreTrainer.

    python examples/trainer_gpt2.py --steps 20 --dir ts-data/trainer

Trains a tiny GPT-2 (built from a config), saves checkpoint-N (model.safetensors + tierstore_optimizer/),
resumes from the first checkpoint in a fresh trainer, and reloads the final model with from_pretrained.
"""
from __future__ import annotations

import argparse
import os

import torch
from _tiny import tiny_gpt2, token_rows
from transformers import GPT2LMHeadModel, TrainingArguments

from tierstore.integrations.trainer import TierstoreTrainer
from tierstore.zero import OffloadConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dir", default="ts-data/trainer")
    a = p.parse_args()
    data = [{"input_ids": x, "labels": x} for x in token_rows(64)]
    config = OffloadConfig(params="host", optimizer_states="nvme", gradients="host",
                           nvme_paths=[os.path.join(a.dir, "nvme")])

    def targs(out: str) -> TrainingArguments:
        return TrainingArguments(os.path.join(a.dir, out), max_steps=a.steps, per_device_train_batch_size=8,
                                 learning_rate=1e-3, max_grad_norm=1.0, logging_steps=max(1, a.steps // 4),
                                 save_steps=max(1, a.steps // 2), report_to=[], use_cpu=True,
                                 optim="adamw_torch", disable_tqdm=True)

    args = targs("run")
    trainer = TierstoreTrainer(model=tiny_gpt2(), args=args, train_dataset=data, offload_config=config)
    trainer.train()
    trainer.save_model(os.path.join(a.dir, "final"))
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    print(f"trained {a.steps} steps; logged grad norms {[round(n, 3) for n in norms]}")

    # resume from the first checkpoint in a new trainer (new model, new store): it continues exactly. It saves
    # into its own output_dir: the first trainer's optimizer, still open, is the writer of the first one's
    first = os.path.join(a.dir, "run", f"checkpoint-{max(1, a.steps // 2)}")
    again = TierstoreTrainer(model=tiny_gpt2(), args=targs("resumed-run"), train_dataset=data,
                             offload_config=config.replace(nvme_paths=[os.path.join(a.dir, "nvme2")]))
    again.train(resume_from_checkpoint=first)
    again.save_model(os.path.join(a.dir, "resumed"))

    final = GPT2LMHeadModel.from_pretrained(os.path.join(a.dir, "final")).state_dict()
    resumed = GPT2LMHeadModel.from_pretrained(os.path.join(a.dir, "resumed")).state_dict()
    same = all(torch.equal(final[k], resumed[k]) for k in final)
    print(f"from_pretrained: {sum(v.numel() for v in final.values())} weights; resumed run equal: {same}")
    if not same:
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
