"""The names under which Zero3Optimizer keeps a rank's tensors in its Store, one function per kind.

[Note: store keys]
Every tensor of a sub-group (global id ``gid``) lives in the optimizer's own Store under one name: its
parameter shard in the compute dtype ``p{gid}``, its fp32 master ``m{gid}`` (trainable sub-groups), its
gradient partition ``g{gid}`` (between backward and step), and each optimizer state ``s{gid}.{key}`` (fp32,
or the packed 8-bit buffer of [Note: 8-bit states] in state8.py). The names never leave the process (a
checkpoint records tensors by sub-group and role, not by these names), so they can change freely; every
site in zero/ builds them here.
"""
from __future__ import annotations


def param(gid: int) -> str:
    """The parameter shard of sub-group `gid`, in the compute dtype (absent under [Note: shared master])."""
    return f"p{gid}"


def master(gid: int) -> str:
    """The fp32 master shard of trainable sub-group `gid`."""
    return f"m{gid}"


def grad(gid: int) -> str:
    """The fp32 gradient partition of sub-group `gid` (from the first reduction after zero_grad())."""
    return f"g{gid}"


def kind(name: str) -> str:
    """What a name built here holds: "params", "master", "grads" or "states"."""
    return {"p": "params", "m": "master", "g": "grads", "s": "states"}[name[:1]]


def state(gid: int, name: str) -> str:
    """Optimizer state `name` (e.g. "exp_avg") of sub-group `gid`."""
    return f"s{gid}.{name}"
