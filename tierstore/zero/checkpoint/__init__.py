"""Checkpoints of a Zero3Optimizer: atomic, checksummed, streamed one sub-group at a time, loadable at another
world size and on other tiers. This module is their public entry; the work is done in:

    save.py         save_checkpoint ([Note: atomic checkpoints], [Note: a failed save], [Note: client state])
    load.py         load_checkpoint ([Note: streaming save and load], [Note: resharding on load])
    verify.py       a load's two passes ([Note: a failed load changes nothing])
    consolidate.py  consolidate: the full model as one state_dict
    records.py      the record files ([Note: checkpoint record files], [Note: checkpoints are untrusted input])
    meta.py         meta.json, read_meta
    directory.py    the checkpoint directory: its writer lock, `latest`, what a save removes
    args.py         the arguments the entry points check
    frozen.py       checkpoints without the frozen parameters
    rng.py          rng_state / set_rng_state, for a client_state
    rank_state.py   this rank's state as one dict, for the optimizer's state_dict() / load_state_dict()

Layout of a checkpoint directory:

    <dir>/latest                             the name of the current checkpoint (replaced atomically)
    <dir>/writer.lock                        held by the job that writes here (directory.py)
    <dir>/ckpt-00000020-<nonce>/meta.json     format, world size, partition layout, hyperparameters, per-file
                                              size and index crc32c
    <dir>/ckpt-00000020-<nonce>/rank00000.bin that rank's fp32 master and state shards, per sub-group (records)
    <dir>/ckpt-00000020-<nonce>/buffers.bin   the model's buffers (rank 0; records)
    <dir>/ckpt-00000020-<nonce>/tierstore-checkpoint.json   written first: the mark that tierstore made it
"""
from __future__ import annotations

from .consolidate import consolidate
from .load import load_checkpoint
from .meta import FORMAT, READABLE, read_meta
from .records import VERSION
from .rng import rng_state, set_rng_state
from .save import save_checkpoint

__all__ = ["FORMAT", "READABLE", "VERSION", "consolidate", "load_checkpoint", "read_meta", "rng_state",
           "save_checkpoint", "set_rng_state"]
