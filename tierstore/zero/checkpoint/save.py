"""save_checkpoint: every rank streams its record file, rank 0 the buffers and meta.json, and only then
``latest`` names the new checkpoint; a failure on any rank fails the save on every rank and leaves the previous
checkpoint as it was.

[Note: atomic checkpoints]
A save writes a new directory next to the old ones: every rank streams its file (temp name, fsync, rename),
the ranks agree on sizes and index crc32c, then rank 0 writes meta.json (temp, fsync, rename, fsync dir) and
only then replaces ``latest`` (temp, fsync, rename, fsync dir). A crash anywhere before that rename leaves
``latest`` naming the previous, complete checkpoint; older directories are deleted only after it. A load
reads ``latest``, checks meta.json's own crc32c, each file's size and index crc32c, and each record's crc32c.
"""
from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import torch

from ...errors import MisuseError, TierstoreError, TierstoreIOError, TierstoreValueError, advice
from .. import _dist, keys
from . import args as ckpt_args
from . import directory as ckpt_dir
from . import frozen as frozen_ckpt
from . import meta as ckpt_meta
from .directory import LATEST
from .records import RecordWriter, encode_client


def save_checkpoint(opt, directory: str | os.PathLike, *, keep: int | None = 1, client_state: Any = None,
                    exclude_frozen: bool = False) -> str:
    """Write a checkpoint of `opt` (every rank calls it) and return its directory. See [Note: atomic
    checkpoints], [Note: a failed save] and [Note: streaming save and load] in load.py. keep: how many previous
    checkpoints to leave besides the new one, an int >= 0, or None for all (rank 0 deletes older ones, of
    tierstore's own only: [Note: what save_checkpoint removes] in directory.py); one job at a time writes a
    directory ([Note: one writer per checkpoint directory] in directory.py). client_state: this rank's own state to
    keep with it (an LR scheduler's state_dict, rng_state(), a data position ...), returned by load_checkpoint;
    see [Note: client state]. exclude_frozen: leave the frozen parameters out ([Note: frozen parameters left
    out of a checkpoint] in frozen.py).

    [Note: client state]
    Each rank's client_state goes into its own rank file: tagged JSON in the file's index (key "client", the
    encoding of the optimizer's aux state, so nothing is pickled), its tensors as crc-checked records
    ``client.<k>``. It is committed with everything else -- the file's size and index crc32c are in meta.json,
    and `latest` names the checkpoint only after that -- so a crash during a save leaves the previous
    checkpoint's client state with the previous checkpoint. A type it cannot hold is refused before the save
    commits anything. load_checkpoint returns this rank's client state (rank 0's when the checkpoint was saved
    by fewer ranks; None when none was given); files written before it have no "client" key and load as None.

    [Note: a failed save]
    Any rank's failure (a full disk, EIO ...) fails the save on every rank with a TierstoreIOError naming
    the rank and the file: each phase ends in a collective that carries every rank's outcome -- the
    checkpoint's name from rank 0, the rank files' sizes, rank 0's meta.json and ``latest`` -- so a rank
    that failed still takes part and none waits for it forever. The new checkpoint directory is then
    removed, and ``latest`` and the previous checkpoints are untouched. Except when ``latest`` was renamed
    but the directory fsync after it failed: a crash may leave either checkpoint named, so both are kept
    (older ones are not deleted) and the error says so."""
    ckpt_args.save_args(opt, directory)
    directory = os.path.abspath(os.fspath(directory))
    group = opt.group
    # the arguments, checked on every rank before anything is created (the ranks agree on the outcome, so
    # none waits in a collective for a rank that refused); [Note: what save_checkpoint removes] in directory.py
    client = None  # (tagged JSON, tensors) of client_state
    bad = None
    try:
        ckpt_dir.check_keep(keep)
        client = None if client_state is None else encode_client(client_state)
    except TierstoreValueError as e:
        bad = e
    refusals = _dist.all_gather_object(None if bad is None else str(bad), group)
    if bad is not None:
        raise bad
    if any(refusals):
        who = next(r for r, m in enumerate(refusals) if m)
        raise TierstoreValueError(f"save_checkpoint refused on rank {who} ({refusals[who]}); nothing was written")
    name = None
    failed = None  # this rank's failure: (path, exception)
    refused = None  # rank 0: another writer holds it ([Note: one writer per checkpoint directory] in directory.py)
    made = False  # rank 0 created the new directory (only then may a failure remove it)
    if opt.rank == 0:
        name = f"ckpt-{opt.steps:08d}-{uuid.uuid4().hex[:8]}"
        made, refused, failed = ckpt_dir.begin(opt, directory, name)
    name, failures, why = _dist.broadcast_object((name, _outcome(opt.rank, failed), None if refused is None
                                                  else str(refused)), 0, group)
    sub = os.path.join(directory, name)
    if why is not None:
        if refused is not None:
            raise refused
        raise MisuseError(f"save_checkpoint refused on rank 0: {why}")
    if failures:
        _save_failed(opt, sub, failures, failed, made=made)
    fname = f"rank{opt.rank:05d}.bin"
    info = None
    try:
        where = os.path.join(sub, fname)
        w = RecordWriter(where)
        try:
            if client is not None:
                w.set_client(client)
            for gl in opt.layout.groups:
                for gid in gl.gids:
                    if not gl.trainable:
                        if not exclude_frozen:
                            w.tensor(f"{gid}.param", opt.store.get(keys.param(gid), device="cpu"))
                        continue
                    sg = opt.export_subgroup(gid)  # one sub-group in memory at a time
                    w.tensor(f"{gid}.master", sg.pop("master"))
                    for k in list(sg["state"]):
                        w.tensor(f"{gid}.state.{k}", sg["state"].pop(k))
                    w.set_aux(gid, sg["aux"])
                    del sg
            info = w.finish()
        except BaseException:
            w.abort()
            raise
    except Exception as e:
        failed = (where, e)
    frozen = frozen_ckpt.fingerprint(opt) if exclude_frozen else None  # every rank: a collective
    gathered = _dist.all_gather_object((fname, info, _outcome(opt.rank, failed)), group)
    failures = [f for _fn, _i, out in gathered for f in out]
    if failures:
        _save_failed(opt, sub, failures, failed)
    files = [(f, *i) for f, i, _out in gathered]
    renamed = False  # rank 0: `latest` names the new checkpoint
    if opt.rank == 0:
        try:
            where = os.path.join(sub, "buffers.bin")
            bw = RecordWriter(where)
            try:
                for n, b in opt.model.named_buffers():
                    bw.tensor(n, b)
                files.append(("buffers.bin", *bw.finish()))
            except BaseException:
                bw.abort()
                raise
            body = {"world_size": opt.world_size, "layout": opt.layout.to_dict(), "param_groups": _jsonable(
                opt.hyperparams()), "optimizer": f"{opt.optimizer_class.__module__}.{opt.optimizer_class.__name__}",
                "compute_dtype": str(opt.config.compute_dtype).removeprefix("torch."), "steps": opt.steps,
                "scaler": opt.scaler_state(), "aliases": opt.param_aliases,
                "files": {f: {"nbytes": n, "index_crc32c": c} for f, n, c in files}}
            if frozen is not None:
                body["frozen"] = frozen
            where = os.path.join(sub, "meta.json")
            ckpt_meta.write_atomic(where, ckpt_meta.encode(body))
            where = os.path.join(directory, LATEST)
            ckpt_meta.write_atomic(where, name.encode())
        except Exception as e:
            failed = (where, e)
            renamed = where.endswith(LATEST) and ckpt_dir.names(where, name)
            for leftover in (where + ".tmp",):
                try:
                    os.unlink(leftover)
                except OSError:
                    pass
    renamed, failures = _dist.broadcast_object((renamed, _outcome(opt.rank, failed)), 0, group)
    if failures:
        _save_failed(opt, sub, failures, failed, renamed)
    if opt.rank == 0:
        ckpt_dir.prune(directory, name, keep)
    _dist.barrier(group)
    return sub



def _outcome(rank: int, failed) -> list[tuple[int, str, int | None, str]]:
    """This rank's failure as picklable data for a collective: [] or [(rank, path, errno, message)]."""
    if failed is None:
        return []
    path, e = failed
    return [(rank, path, getattr(e, "errno", None), f"{type(e).__name__}: {e}")]


def _save_failed(opt, sub: str, failures: list, failed, renamed: bool = False, made: bool = True):
    """Every rank: remove the new checkpoint (rank 0, where it made it) unless `latest` may name it, and
    raise."""
    if opt.rank == 0 and made and not renamed:
        shutil.rmtree(sub, ignore_errors=True)
    rank, path, code, message = failures[0]
    mine = failed is not None and rank == opt.rank
    who = "this rank" if rank == opt.rank else f"rank {rank}"
    if renamed:
        fate = (f"`latest` was replaced but making that durable failed: after a crash it names either the new "
                f"checkpoint {sub} or the previous one, so both are kept")
    else:
        fate = "the new checkpoint was removed; `latest` and the previous checkpoints are untouched"
    if code is None:  # not an I/O error (a bug, bad state): the rank that raised it raises it as it was
        if mine:
            raise failed[1]
        raise TierstoreError(f"save_checkpoint failed on {who} ({message}); {fate}")
    cause = advice(code)
    err = TierstoreIOError(code, f"save_checkpoint failed on {who} writing {path} ({message}); {fate}; "
                                 f"{cause + ', then' if cause else 'fix that, then'} call save_checkpoint again", path)
    if mine:
        raise err from failed[1]
    raise err


def _jsonable(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        d = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v.tolist()
            d[k] = list(v) if isinstance(v, tuple) else v
        out.append(d)
    return out
