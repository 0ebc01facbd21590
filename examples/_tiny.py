"""What the examples share: a tiny GPT-2 built from a config (no download) and random token batches."""
from __future__ import annotations

import torch


def tiny_gpt2(width: int = 64, layers: int = 2, vocab: int = 256, context: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=width, n_layer=layers, n_head=2, vocab_size=vocab,
                                      n_positions=context, bos_token_id=0, eos_token_id=0))


def token_rows(n: int, length: int = 32, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)
