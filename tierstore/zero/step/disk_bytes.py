"""Bytes the ZeRO-3 optimizer of one rank moves to and from the persistent (nvme) tier, by kind.

[Note: disk bytes by kind]
The store counts the bytes each tier moves (``store.stats()``), not what they are. The optimizer knows:
each time it reads or writes one of its tensors (parameter shard, gradient partition, fp32 master,
optimizer state; [Note: store keys] in keys.py) and that access goes to the persistent tier -- the tensor
has no copy on a memory tier -- the tensor's bytes as stored there (8-bit states encoded) are added to its
kind. ``OptimizerStats.disk_read`` / ``disk_written`` hold the totals since construction; `tierstore bench
optim` prints them per parameter per step.
"""
from __future__ import annotations

import threading

from ...tiers import tier_info
from .. import keys

KINDS = ("params", "grads", "master", "states")


class DiskBytes:
    """Running totals of bytes read from / written to the persistent tier, by kind (thread-safe: the step
    pipeline's reader and writer threads count too)."""

    def __init__(self, store):
        self.store = store
        self.read = dict.fromkeys(KINDS, 0)  # bytes
        self.written = dict.fromkeys(KINDS, 0)  # bytes
        self._lock = threading.Lock()

    def count(self, name: str, *, write: bool, kind: str | None = None) -> None:
        """Tensor `name` was just read (or written): count its stored bytes if that went to the disk, under
        `kind` (default: what the name holds; a shared master read to be gathered counts as "params")."""
        t = self.store.tensor(name)
        tiers = t.tiers
        if not tiers or any(tier_info(tr).memory for tr in tiers):
            return
        nbytes = t.encoded_nbytes or 0
        kind = kind or keys.kind(name)
        with self._lock:
            (self.written if write else self.read)[kind] += nbytes
