"""transformers' Trainer and accelerate."""
