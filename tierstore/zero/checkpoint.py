"""Checkpoints of a Zero3Optimizer: atomic, checksummed, loadable at another world size and on other tiers.

Layout of a checkpoint directory:

    <dir>/latest                          the name of the current checkpoint (replaced atomically)
    <dir>/ckpt-00000020-<nonce>/meta.json  format, world size, partition layout, hyperparameters, per-file crc32c
    <dir>/ckpt-00000020-<nonce>/rank00000.pt  that rank's fp32 master and state shards, per sub-group
    <dir>/ckpt-00000020-<nonce>/buffers.pt    the model's buffers (rank 0)

[Note: atomic checkpoints]
A save writes a new directory next to the old ones: every rank writes its file (temp name, fsync, rename),
the ranks agree on sizes and crc32c, then rank 0 writes meta.json (temp, fsync, rename, fsync dir) and only
then replaces ``latest`` (temp, fsync, rename, fsync dir). A crash anywhere before that rename leaves
``latest`` naming the previous, complete checkpoint; older directories are deleted only after it. A load
reads ``latest``, checks meta.json's own crc32c and every file's crc32c before using it.

[Note: resharding on load]
Every shard file holds fp32 shards of buckets of the layout the saving run used. A load rebuilds this rank's
shards under its own layout with ``partition.reshard_shards`` over fp32 twins of both plans (see
[Note: fp32 twin plans] in _layout.py), reading each source file once; states with one element per
parameter element (exp_avg, sum, momentum_buffer ...) move the same way, scalar states (step) are taken
from the first source sub-group of the group (every sub-group steps together). Tiers are whatever the
loading optimizer's config says.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import uuid

import crc32c
import torch

from ..errors import CorruptionError, TierstoreValueError
from ..io.files import fsync_dir
from ..partition import Plan, reshard_shards
from . import _dist
from ._layout import fp32_twin

FORMAT = "tierstore.zero.checkpoint"
VERSION = 1
LATEST = "latest"


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _body_crc(body: dict) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def save_checkpoint(opt, directory: str | os.PathLike, *, keep: int = 1) -> str:
    """Write a checkpoint of `opt` (every rank calls it) and return its directory. See [Note: atomic
    checkpoints]. keep: how many previous checkpoints to leave besides the new one (rank 0 deletes older)."""
    directory = os.path.abspath(os.fspath(directory))
    group = opt.group
    name = None
    if opt.rank == 0:
        os.makedirs(directory, exist_ok=True)
        name = f"ckpt-{opt.steps:08d}-{uuid.uuid4().hex[:8]}"
    name = _dist.broadcast_object(name, 0, group)
    sub = os.path.join(directory, name)
    if opt.rank == 0:
        os.makedirs(sub)
    _dist.barrier(group)
    shards = {}
    for gl in opt.layout.groups:
        for gid in gl.gids:
            if gl.trainable:
                shards[gid] = opt._export_subgroup(gid)
            else:
                shards[gid] = {"param": opt.store.get(f"p{gid}", device="cpu")}
    data = _torch_bytes(shards)
    fname = f"rank{opt.rank:05d}.pt"
    _write_atomic(os.path.join(sub, fname), data)
    files = _dist.all_gather_object((fname, len(data), crc32c.crc32c(data)), group)
    del data, shards
    if opt.rank == 0:
        buffers = {n: b.detach().cpu() for n, b in opt.model.named_buffers()}
        bdata = _torch_bytes(buffers)
        _write_atomic(os.path.join(sub, "buffers.pt"), bdata)
        files.append(("buffers.pt", len(bdata), crc32c.crc32c(bdata)))
        body = {"world_size": opt.world_size, "layout": opt.layout.to_dict(), "param_groups": _jsonable(
            opt._hyperparams()), "optimizer": f"{opt.optimizer_class.__module__}.{opt.optimizer_class.__name__}",
            "compute_dtype": str(opt.config.compute_dtype).removeprefix("torch."), "steps": opt.steps,
            "scaler": opt._scaler.state_dict(), "aliases": opt._aliases,
            "files": {f: {"nbytes": n, "crc32c": c} for f, n, c in files}}
        doc = {"format": FORMAT, "version": VERSION, "crc32c": _body_crc(body), "body": body}
        _write_atomic(os.path.join(sub, "meta.json"), json.dumps(doc, indent=1).encode())
        _write_atomic(os.path.join(directory, LATEST), name.encode())
        old = sorted(d for d in os.listdir(directory) if d.startswith("ckpt-") and d != name)
        old_complete = [d for d in old if os.path.exists(os.path.join(directory, d, "meta.json"))]
        for d in old:
            if d not in old_complete[len(old_complete) - keep:] or keep == 0:
                shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
    _dist.barrier(group)
    return sub


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


def read_meta(directory: str | os.PathLike) -> tuple[str, dict]:
    """(checkpoint subdirectory, meta body) of the latest checkpoint in `directory`, checked."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        with open(os.path.join(directory, LATEST), "rb") as f:
            name = f.read().decode().strip()
    except FileNotFoundError:
        raise TierstoreValueError(f"no checkpoint in {directory} (no {LATEST!r} file); write one with "
                                  f"opt.save_checkpoint({directory!r})") from None
    sub = os.path.join(directory, name)
    path = os.path.join(sub, "meta.json")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        body = doc["body"]
        ok = doc.get("format") == FORMAT and doc.get("crc32c") == _body_crc(body)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptionError(f"checkpoint metadata unreadable: {e}", path) from None
    if not ok:
        raise CorruptionError("checkpoint metadata fails its crc32c (or is not a tierstore checkpoint)", path)
    if doc.get("version") != VERSION:
        raise TierstoreValueError(f"{path} is checkpoint version {doc.get('version')}; this tierstore reads "
                                  f"version {VERSION}")
    return sub, body


class _Files:
    """Shard files of a checkpoint, opened lazily, each checked against its crc32c once."""

    def __init__(self, sub: str, body: dict):
        self.sub = sub
        self.body = body
        self._cache: dict[str, dict] = {}

    def load(self, fname: str):
        if fname not in self._cache:
            path = os.path.join(self.sub, fname)
            with open(path, "rb") as f:
                data = f.read()
            want = self.body["files"].get(fname)
            if want is None or len(data) != want["nbytes"] or crc32c.crc32c(data) != want["crc32c"]:
                raise CorruptionError(f"checkpoint file fails its size/crc32c check (expected {want}, got "
                                      f"{len(data)} bytes)", path)
            self._cache[fname] = torch.load(io.BytesIO(data), weights_only=False)
        return self._cache[fname]

    def rank(self, r: int) -> dict:
        return self.load(f"rank{r:05d}.pt")


def _source_layout(body: dict) -> list[tuple[int, Plan, list[int]]]:
    """(group index, plan, gids) per group of the saved layout."""
    out, gid = [], 0
    for g in body["layout"]["groups"]:
        p = Plan.from_dict(g["plan"])
        out.append((g["index"], p, list(range(gid, gid + len(p.buckets)))))
        gid += len(p.buckets)
    return out


def load_checkpoint(opt, directory: str | os.PathLike) -> None:
    """Load the latest checkpoint in `directory` into `opt` (every rank calls it), resharding to this world
    size and layout. See [Note: resharding on load]."""
    sub, body = read_meta(directory)
    files = _Files(sub, body)
    src = _source_layout(body)
    if len(src) != len(opt.layout.groups):
        raise TierstoreValueError(f"the checkpoint has {len(src) - 1} parameter groups; this optimizer has "
                                  f"{len(opt.layout.groups) - 1}")
    me = opt.rank
    for (s_index, s_plan, s_gids), gl in zip(src, opt.layout.groups):
        if s_index != gl.index or set(s_plan.params) != set(gl.plan.params):
            raise TierstoreValueError(f"parameter group {gl.index} holds other parameters in the checkpoint "
                                      f"({sorted(set(s_plan.params) ^ set(gl.plan.params))[:3]} differ); build "
                                      f"the same model and param_groups")
        if not gl.gids:
            continue
        if not gl.trainable:
            new = reshard_shards(s_plan, gl.plan, lambda b, r: files.rank(r)[s_gids[b]]["param"].to(
                s_plan.buckets[b].dtype), dst_ranks=[me])
            for b, gid in enumerate(gl.gids):
                opt.store.put(f"p{gid}", new[b, me].to(opt.device, opt.config.compute_dtype), tier=opt.config.params)
            continue
        s32, d32 = fp32_twin(s_plan), fp32_twin(gl.plan)
        first = files.rank(0)[s_gids[0]]
        masters = reshard_shards(s32, d32, lambda b, r: files.rank(r)[s_gids[b]]["master"], dst_ranks=[me])
        states: dict[str, dict] = {}
        scalars: dict[str, torch.Tensor] = {}
        for k, v in first["state"].items():
            if v.dim() == 1 and v.numel() == s_plan.buckets[0].shard_numel:
                states[k] = reshard_shards(s32, d32, lambda b, r, k=k: files.rank(r)[s_gids[b]]["state"][k].to(
                    torch.float32), dst_ranks=[me])
            else:
                scalars[k] = v
        for b, gid in enumerate(gl.gids):
            st = {k: states[k][b, me] for k in states}
            st.update({k: v.clone() for k, v in scalars.items()})
            opt._import_subgroup(gid, masters[b, me], st, dict(first["aux"]))
    opt._set_hyperparams(body["param_groups"])
    opt._scaler.load_state_dict(body["scaler"])
    opt.steps = body["steps"]
    buffers = files.load("buffers.pt")
    for n, b in opt.model.named_buffers():
        if n in buffers:
            b.data.copy_(buffers[n].to(b.dtype))
    opt.zero_grad()
    opt.coordinator.release_all()
    _dist.barrier(opt.group)


def consolidate(directory: str | os.PathLike, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model of the latest checkpoint in `directory` as a plain state_dict (every parameter name,
    tied aliases included, and the buffers), for torch.save / safetensors. Runs in one process.

    dtype: of the parameters (default: the compute dtype of the run that saved it; float32 gives the
    masters themselves)."""
    sub, body = read_meta(directory)
    files = _Files(sub, body)
    world = body["world_size"]
    cdt = getattr(torch, body["compute_dtype"])
    values: dict[str, torch.Tensor] = {}
    for index, plan, gids in _source_layout(body):
        key = "master" if index >= 0 else "param"
        buckets = []
        for b, gid in enumerate(gids):
            full = torch.cat([files.rank(r)[gid][key].to(torch.float32) for r in range(world)])
            buckets.append(full.to(plan.buckets[b].dtype) if index < 0 else full)
        if index >= 0:
            plan = fp32_twin(plan)
        for n, t in plan.unflatten(buckets).items():
            values[n] = t.to(dtype or cdt)
    out = {alias: values[canon] for alias, canon in body["aliases"].items()}
    out.update(files.load("buffers.pt"))
    return out
