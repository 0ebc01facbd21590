"""The state of every RNG a training loop draws from, in the types a checkpoint's client_state holds."""
from __future__ import annotations

from typing import Any

import torch

from ...errors import TierstoreValueError


def rng_state() -> dict:
    """Every RNG a training loop draws from -- torch's CPU generator (and each CUDA device's, where CUDA is
    initialised), Python's `random`, numpy's global generator -- in types a checkpoint's client_state holds;
    set_rng_state(d) puts them back, so a resumed run draws what the uninterrupted one would have."""
    import random

    import numpy as np
    kind, key, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": [kind, torch.from_numpy(np.ascontiguousarray(key)), int(pos), int(has_gauss),
                                     float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # CUDA only: tests/test_accelerator.py
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned (after a load_checkpoint)."""
    import random

    import numpy as np
    if not isinstance(state, dict) or not {"torch", "python", "numpy"} <= set(state):
        raise TierstoreValueError("set_rng_state takes the dict rng_state() returned (keys torch, python, numpy)")
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy(), pos, has_gauss, cached))
    if "cuda" in state:  # CUDA only: tests/test_accelerator.py
        torch.cuda.set_rng_state_all(state["cuda"])
