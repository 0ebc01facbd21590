"""ZeRO-3 over the store: the optimizer, its hooks, step, parameters, checkpoints, inference."""
