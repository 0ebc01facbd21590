"""Checkpoints of a Zero3Optimizer: atomic, checksummed, streamed one sub-group at a time, loadable at another
world size and on other tiers.

Layout of a checkpoint directory:

    <dir>/latest                             the name of the current checkpoint (replaced atomically)
    <dir>/writer.lock                        held by the job that writes here (ckpt_dir.py)
    <dir>/ckpt-00000020-<nonce>/meta.json     format, world size, partition layout, hyperparameters, per-file
                                              size and index crc32c
    <dir>/ckpt-00000020-<nonce>/rank00000.bin that rank's fp32 master and state shards, per sub-group (records)
    <dir>/ckpt-00000020-<nonce>/buffers.bin   the model's buffers (rank 0; records)
    <dir>/ckpt-00000020-<nonce>/tierstore-checkpoint.json   written first: the mark that tierstore made it

[Note: checkpoint record files]
A ``.bin`` file (version 3; 2 differed only in its aux state) is written front to back in one pass and read
by random access:

    offset 0      8 bytes   magic b"TSZCKPT2"
    offset 8      records   each tensor's raw bytes (little-endian, C order), back to back, no padding
    index_offset  index     UTF-8 JSON: {"format", "version", "byteorder": "little",
                            "records": {name: {"dtype", "shape", "offset", "nbytes", "crc32c"}},
                            "aux": {gid: the sub-group's non-tensor optimizer state, tagged JSON},
                            "client": {"state": the caller's client_state, tagged JSON} (when given)}
    end - 24      footer    little-endian u64 index_offset, u64 index_nbytes, u32 crc32c of the index, b"TSZI"

Record names: ``<gid>.master``, ``<gid>.state.<key>`` (fp32, 8-bit states dequantised), ``<gid>.param``
(frozen sub-groups, compute dtype), ``<gid>.aux.<k>`` (the k-th tensor inside the aux state), ``client.<k>``
(the k-th tensor of the client state, [Note: client state] at save_checkpoint); in buffers.bin
the buffer names. meta.json (``{"format", "version", "crc32c", "body"}``; the crc32c covers the body, which
from version 3 holds the version too) lists every file's size and its index crc32c, so a file swapped in
from another checkpoint, a truncated one or a damaged index is refused before any record is used; each
record carries its own crc32c, checked when it is read (a CorruptionError names the file, the record, its
offset and length). Every byte of a file belongs to the magic, a record, the index or the footer, so any
damaged byte is detected by whichever read covers it.
Writes are plain buffered ``os.write`` calls of each tensor's memory (no copy into a bytes object), one
fsync per file at the end: records come from ``store.get`` into ordinary memory at arbitrary sizes (a 0-d
``step``, small states), so the engine's O_DIRECT path would need them staged into aligned pinned buffers
first -- a copy and code for a periodic operation the page cache already streams at disk speed. After the
fsync the file's pages are dropped from the page cache (posix_fadvise DONTNEED): a checkpoint is not read
back soon and should not evict the run's working set.

[Note: atomic checkpoints]
A save writes a new directory next to the old ones: every rank streams its file (temp name, fsync, rename),
the ranks agree on sizes and index crc32c, then rank 0 writes meta.json (temp, fsync, rename, fsync dir) and
only then replaces ``latest`` (temp, fsync, rename, fsync dir). A crash anywhere before that rename leaves
``latest`` naming the previous, complete checkpoint; older directories are deleted only after it. A load
reads ``latest``, checks meta.json's own crc32c, each file's size and index crc32c, and each record's crc32c.

[Note: streaming save and load]
Save reads one sub-group (master and states, from whatever tier) from the store, appends its records to the
rank file and drops it before reading the next, so its memory is about one sub-group whatever the model
size. Load builds this rank's shards one destination sub-group at a time: ``partition.reshard_copies`` (what
``reshard_shards`` is built on) lists, for this rank only, which runs of which source shards make each
destination shard; the source records are read as needed, keeping only the last source sub-group read (the
copies go through both plans in model order, so a source record is normally read once). Memory: one source
and one destination sub-group.

[Note: resharding on load]
Every shard file holds fp32 shards of buckets of the layout the saving run used. A load rebuilds this rank's
shards under its own layout over fp32 twins of both plans (see [Note: fp32 twin plans] in _layout.py); states
with one element per parameter element (exp_avg, sum, momentum_buffer ...) move the same way. Sub-groups
do not all step together: one whose parameters never got a gradient has no states yet, and one skipped on
some steps has its own `step` ([Note: skipped parameters] in skipped.py). So the state keys are read per
source sub-group: a destination sub-group takes the per-element states its sources hold (elements from a
source without one get the value before a first step: 0, or the optimizer's eager initial state), its
scalar states from the first of its sources that was stepped -- exact when the layouts match, the usual
resume; merged onto another layout, sources with different counts share that one -- and no states at all
when none of its sources was stepped (its first step creates them, as in a new run). Tiers are whatever
the loading optimizer's config says.

[Note: checkpoints are untrusted input]
A checkpoint directory may come from anywhere (a shared filesystem, a download), and a crc32c protects
against damage, not against whoever wrote the file: they compute it too. So nothing in a checkpoint is
executed or unpickled, and every field is checked before it is used to open, allocate or index anything:
`latest` must be a plain name in the directory (``ckpt-<steps>-<hex>``), meta.json's fields their types and
ranges, each record's place inside its file before the index, no two records overlapping, nbytes equal to
prod(shape) x itemsize of a known dtype, and the records a load uses of the size the layout says. A
malformed file is a CorruptionError naming the file and the field. The optimizer's non-tensor state (the
"aux" of a sub-group) is written in tagged JSON (see _encode_aux); types it cannot hold are refused when
the checkpoint is saved. Version 1 (torch.save'd dicts) and the pickled ``<gid>.aux`` records version 2
wrote for non-JSON state are refused, not read with torch.load(weights_only=True): that restricted unpickler
is still a parser of attacker-chosen opcodes, has had bypasses, and would be a second format to keep safe
for files a re-save converts.
Version 2 checkpoints without ``<gid>.aux`` records load (their aux state is plain JSON); any other version
is refused with its number.
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import sys
import uuid
from typing import Any, NoReturn, TypeGuard

import crc32c
import torch

from ..errors import CorruptionError, MisuseError, TierstoreError, TierstoreIOError, TierstoreValueError, advice
from ..io.checksum import crc_at, memory_at
from ..io.files import fsync_dir, own_open, read_small
from ..manifest import STORED_DTYPES
from ..partition import Plan, reshard_copies
from . import _dist, ckpt_args, ckpt_dir, ckpt_verify, frozen_ckpt, keys
from ._layout import fp32_twin
from .ckpt_dir import LATEST

FORMAT = "tierstore.zero.checkpoint"
VERSION = 3
READABLE = (2, 3)  # versions load_checkpoint / consolidate read (2: aux state as plain JSON, no pickled records)
FILE_FORMAT = "tierstore.zero.checkpoint.records"
MAGIC = b"TSZCKPT2"
FOOTER = struct.Struct("<QQI4s")  # index_offset, index_nbytes, index crc32c, b"TSZI"
FOOTER_MAGIC = b"TSZI"
_META_MAX = 256 << 20  # bytes of meta.json: the layout lists every parameter (~1 KB each), 200k+ of them
_AUX_TAGS = ("tuple", "dict", "float", "tensor")
_AUX_DEPTH = 64  # nesting levels of aux state
_RECORD_DTYPES = STORED_DTYPES  # dtypes a record may hold


def _write_atomic(path: str, data: bytes) -> None:
    """`path` replaced by `data` (temp, fsync, rename, fsync dir); neither name may be a symlink ([Note:
    tierstore's own files] in io/files.py)."""
    tmp = path + ".tmp"
    ckpt_dir.refuse_link(path)
    ckpt_dir.refuse_link(tmp)
    fd = own_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what="write")
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _body_crc(body: dict) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _record_dtype_name(dt: torch.dtype) -> str:
    name = _dtype_name(dt)
    if _RECORD_DTYPES.get(name) != dt:
        raise TierstoreValueError(f"a checkpoint record cannot hold dtype {dt}; it holds "
                                  f"{', '.join(_RECORD_DTYPES)}")
    return name


class _RecordWriter:
    """One record file, written front to back under a temporary name; see [Note: checkpoint record files]."""

    def __init__(self, path: str):
        if sys.byteorder != "little":  # the format is little-endian; tensors are written as they are in memory
            raise TierstoreValueError("checkpoints are written little-endian; this machine is big-endian")
        self.path = path
        self.tmp = path + ".tmp"
        self.fd: int | None = own_open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                       what="write")  # None once finished or aborted
        self.records: dict[str, dict] = {}
        self.aux: dict[str, dict] = {}
        self.client: Any = None  # the tagged JSON of client_state; None: none given
        self.at = 0  # bytes written
        self._write(memoryview(MAGIC))

    def _write(self, mv: memoryview) -> None:
        fd = self.fd
        assert fd is not None  # written only before finish() or abort()
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done:])
        self.at += len(mv)

    def tensor(self, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        mv = memory_at(t.data_ptr(), nbytes) if nbytes else memoryview(b"")
        self.records[name] = {"dtype": _record_dtype_name(t.dtype), "shape": list(t.shape), "offset": self.at,
                              "nbytes": nbytes, "crc32c": crc_at(t.data_ptr(), nbytes)}
        self._write(mv)
        del mv, t

    def set_aux(self, gid: int, aux: dict) -> None:
        """Sub-group `gid`'s non-tensor optimizer state, in tagged JSON (tensors in it as records
        ``<gid>.aux.<k>``); TierstoreValueError, before anything of it is written, for a type it cannot hold.
        See [Note: checkpoints are untrusted input]."""
        if not aux:
            return
        tensors: list[torch.Tensor] = []
        enc = _encode_aux(dict(aux), tensors, f"optimizer state of sub-group {gid}")
        for k, t in enumerate(tensors):
            self.tensor(f"{gid}.aux.{k}", t)
        self.aux[str(gid)] = enc

    def set_client(self, encoded: tuple[Any, list[torch.Tensor]]) -> None:
        """The caller's client_state as _encode_client gave it (tagged JSON, its tensors as records
        ``client.<k>``). See [Note: client state]."""
        enc, tensors = encoded
        for k, t in enumerate(tensors):
            self.tensor(f"client.{k}", t)
        self.client = {"state": enc}

    def finish(self) -> tuple[int, int]:
        """Index, footer, fsync, rename, fsync dir; returns (file size, index crc32c)."""
        doc = {"format": FILE_FORMAT, "version": VERSION, "byteorder": "little", "records": self.records,
               "aux": self.aux}
        if self.client is not None:
            doc["client"] = self.client
        index = json.dumps(doc, separators=(",", ":")).encode()
        crc = crc32c.crc32c(index)
        offset = self.at
        self._write(memoryview(index))
        self._write(memoryview(FOOTER.pack(offset, len(index), crc, FOOTER_MAGIC)))
        fd = self.fd
        assert fd is not None  # _write() above checked it
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):  # written and durable: leave the page cache to the run
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(self.path))
        return self.at, crc

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def save_checkpoint(opt, directory: str | os.PathLike, *, keep: int | None = 1, client_state: Any = None,
                    exclude_frozen: bool = False) -> str:
    """Write a checkpoint of `opt` (every rank calls it) and return its directory. See [Note: atomic
    checkpoints], [Note: a failed save] and [Note: streaming save and load]. keep: how many previous
    checkpoints to leave besides the new one, an int >= 0, or None for all (rank 0 deletes older ones, of
    tierstore's own only: [Note: what save_checkpoint removes] in ckpt_dir.py); one job at a time writes a
    directory ([Note: one writer per checkpoint directory] in ckpt_dir.py). client_state: this rank's own state to
    keep with it (an LR scheduler's state_dict, rng_state(), a data position ...), returned by load_checkpoint;
    see [Note: client state]. exclude_frozen: leave the frozen parameters out ([Note: frozen parameters left
    out of a checkpoint] in frozen_ckpt.py).

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
    # none waits in a collective for a rank that refused); [Note: what save_checkpoint removes] in ckpt_dir.py
    client = None  # (tagged JSON, tensors) of client_state
    bad = None
    try:
        ckpt_dir.check_keep(keep)
        client = None if client_state is None else _encode_client(client_state)
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
    refused = None  # rank 0: another writer holds it ([Note: one writer per checkpoint directory] in ckpt_dir.py)
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
        w = _RecordWriter(where)
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
            bw = _RecordWriter(where)
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
            body["version"] = VERSION  # under the crc32c (from version 3)
            doc = {"format": FORMAT, "version": VERSION, "crc32c": _body_crc(body), "body": body}
            where = os.path.join(sub, "meta.json")
            _write_atomic(where, json.dumps(doc, indent=1).encode())
            where = os.path.join(directory, LATEST)
            _write_atomic(where, name.encode())
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


def _encode_client(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """client_state as tagged JSON and the tensors in it; TierstoreValueError for a type it cannot hold."""
    tensors: list[torch.Tensor] = []
    return _encode_aux(state, tensors, "client_state"), tensors


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


def _is_int(v: object) -> TypeGuard[int]:
    return type(v) is int  # bool is not a count, offset or size


def _corrupt(path: str, field: str, what: str) -> NoReturn:
    raise CorruptionError(f"checkpoint file field {field}: {what}; the file is damaged or was not written "
                          "by tierstore: load an older checkpoint", path)


def _check(ok: bool, path: str, field: str, what: str) -> None:
    if not ok:
        _corrupt(path, field, what)


def read_meta(directory: str | os.PathLike) -> tuple[str, dict]:
    """(checkpoint subdirectory, meta body) of the latest checkpoint in `directory`, checked field by field
    ([Note: checkpoints are untrusted input]); the body's "version" is the format version of its files."""
    directory = os.path.abspath(os.fspath(directory))
    for _attempt in range(ckpt_dir.RETRIES):
        name = ckpt_dir.latest_name(directory)
        sub = os.path.join(directory, name)
        path = os.path.join(sub, "meta.json")
        try:
            doc = json.loads(read_small(path, _META_MAX, what="read checkpoint metadata"))
            break
        except TierstoreIOError as e:
            if e.errno != errno.ENOENT:
                raise CorruptionError(f"checkpoint metadata cannot be read ({e.strerror})", path) from None
            if ckpt_dir.vanished(directory, sub, path):  # a writer moved `latest` on and pruned it: again
                continue  # ([Note: readers and a concurrent cleanup] in ckpt_dir.py)
            raise CorruptionError(f"{LATEST!r} names {name}, which has no meta.json; write the name of the newest "
                                  "complete ckpt-* directory into it", path) from None
        except (ValueError, RecursionError) as e:
            raise CorruptionError(f"checkpoint metadata unreadable: {e}", path) from None
    else:
        raise ckpt_dir.removed_error(directory, sub)
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or doc.get("format") != FORMAT or not _is_int(doc.get("crc32c")) \
            or doc["crc32c"] != _body_crc(body):
        raise CorruptionError("checkpoint metadata fails its crc32c (or is not a tierstore checkpoint)", path)
    version = doc.get("version")
    if "version" in body and body["version"] != version:  # from version 3 the version is under the crc32c
        raise CorruptionError(f"checkpoint metadata says version {version!r} outside its checksummed body and "
                              f"{body['version']!r} inside it", path)
    if version == 1:
        raise TierstoreValueError(
            f"{path} is checkpoint format version 1 (torch.save pickles, which can run code when read); this "
            f"tierstore does not read it. Convert a checkpoint you trust with the tierstore that wrote it: "
            f"load_checkpoint, then save_checkpoint writes version {VERSION}")
    if version not in READABLE:
        raise TierstoreValueError(f"{path} is checkpoint format version {version}; this tierstore reads versions "
                                  f"{', '.join(map(str, READABLE))} (and writes {VERSION}): load it with the "
                                  f"tierstore that wrote it")
    _check("version" in body or version == 2, path, "version", f"version {version} must be inside the body")
    _check_body(body, path)
    return sub, {**body, "version": version}


def _check_body(body: dict, path: str) -> None:
    """Every field of meta.json's body that a load or consolidate uses, before anything is read or made."""
    world = body.get("world_size")
    if not (_is_int(world) and world >= 1):  # narrows world to int below
        _corrupt(path, "world_size", f"{world!r} is not a positive integer")
    try:
        src = _source_layout(body)
    except (TierstoreValueError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise CorruptionError(f"checkpoint file field layout: {e}; the file is damaged: load an older checkpoint",
                              path) from None
    indices = [i for i, _p, _g in src]
    _check(indices == list(range(len(src) - 1)) + [-1], path, "layout.groups",
           f"group indices {indices} are not 0, 1, ... then -1 (the frozen parameters)")
    _check(all(p.world_size == world for _i, p, _g in src), path, "layout", f"a plan is not for {world} ranks")
    groups = body.get("param_groups")
    _check(isinstance(groups, list) and len(groups) == len(src) - 1
           and all(isinstance(g, dict) for g in groups), path, "param_groups",
           f"not one dict per parameter group ({len(src) - 1})")
    _check(isinstance(body.get("optimizer"), str), path, "optimizer", "not a string")
    _check(isinstance(_RECORD_DTYPES.get(str(body.get("compute_dtype"))), torch.dtype)
           and _RECORD_DTYPES[body["compute_dtype"]].is_floating_point, path, "compute_dtype",
           f"{body.get('compute_dtype')!r} is not a floating dtype")
    steps = body.get("steps")
    _check(_is_int(steps) and steps >= 0, path, "steps", f"{steps!r} is not a count")
    sc = body.get("scaler")
    _check(isinstance(sc, dict) and type(sc.get("scale")) in (int, float) and _is_int(sc.get("good"))
           and _is_int(sc.get("skipped")), path, "scaler", f"{sc!r} is not {{scale, good, skipped}}")
    params = {n for _i, p, _g in src for n in p.params}
    al = body.get("aliases")
    _check(isinstance(al, dict) and all(isinstance(v, str) and v in params for v in al.values()), path,
           "aliases", "not a map of names to parameters of the layout")
    files = body.get("files")
    want = {f"rank{r:05d}.bin" for r in range(world)} | {"buffers.bin"} if world <= 1 << 20 else set()
    if not (isinstance(files, dict) and set(files) == want):  # narrows files to dict below
        _corrupt(path, "files", f"does not list rank00000.bin ... rank{world - 1:05d}.bin and buffers.bin")
    for f, w in files.items():
        _check(isinstance(w, dict) and _is_int(w.get("nbytes")) and w["nbytes"] >= 0
               and _is_int(w.get("index_crc32c")) and 0 <= w["index_crc32c"] < 1 << 32, path, f"files[{f!r}]",
               f"{w!r} is not {{nbytes, index_crc32c}}")


def _encode_aux(v, tensors: list, where: str, depth: int = 0):
    """Non-tensor optimizer state as tagged JSON: None, bool, int, str and finite floats as themselves, lists
    as arrays; {"tuple": [...]}, {"dict": [[key, value], ...]}, {"float": "nan" | "inf" | "-inf"}, and
    {"tensor": k} for the k-th tensor (written as record ``<gid>.aux.<k>``). Any other type is refused."""
    t = type(v)
    if depth > _AUX_DEPTH:
        raise TierstoreValueError(f"{where} is nested more than {_AUX_DEPTH} levels deep; checkpoints cannot "
                                  "store it")
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is torch.Tensor:
        tensors.append(v)
        return {"tensor": len(tensors) - 1}
    if t is list:
        return [_encode_aux(x, tensors, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if t is tuple:
        return {"tuple": [_encode_aux(x, tensors, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
    if t is dict:
        out = []
        for k, x in v.items():
            if k is not None and type(k) not in (bool, int, float, str):
                raise TierstoreValueError(f"{where} has a key of type {type(k).__name__}; "
                                          "checkpoints store keys that are None, bool, int, float or str")
            out.append([_encode_aux(k, tensors, where, depth + 1), _encode_aux(x, tensors, f"{where}[{k!r}]",
                                                                                depth + 1)])
        return {"dict": out}
    hint = (" (numpy's RNG: tierstore.zero.rng_state() gives every RNG's state in these types; an array: "
            "torch.from_numpy(a))" if t.__module__ == "numpy" else "")
    raise TierstoreValueError(
        f"{where} is a {t.__module__}.{t.__qualname__}; checkpoints store non-tensor state of types None, bool, "
        "int, float, str, list, tuple, dict and torch.Tensor only (nothing is pickled, so loading a checkpoint "
        f"cannot run code): keep it in those types{hint}")


def _decode_aux(j, tensor, path: str, where: str, depth: int = 0):
    """The inverse of _encode_aux; tensor(k) reads the k-th tensor. CorruptionError on anything else."""
    if depth > _AUX_DEPTH:
        _check(False, path, where, f"nested more than {_AUX_DEPTH} levels deep")
    if j is None or type(j) in (bool, int, float, str):
        return j
    if type(j) is list:
        return [_decode_aux(x, tensor, path, f"{where}[{i}]", depth + 1) for i, x in enumerate(j)]
    _check(type(j) is dict and len(j) == 1 and next(iter(j)) in _AUX_TAGS, path, where,
           f"{str(j)[:80]} is not tagged aux state")
    (tag, x), = j.items()
    if tag == "float":
        _check(x in ("nan", "inf", "-inf"), path, where, f"{x!r} is not nan, inf or -inf")
        return float(x)
    if tag == "tensor":
        _check(_is_int(x) and x >= 0, path, where, f"{x!r} is not a tensor number")
        return tensor(x)
    _check(type(x) is list, path, where, f"{tag} of {type(x).__name__}, not a list")
    if tag == "tuple":
        return tuple(_decode_aux(y, tensor, path, f"{where}[{i}]", depth + 1) for i, y in enumerate(x))
    out = {}
    for i, kv in enumerate(x):
        _check(type(kv) is list and len(kv) == 2, path, f"{where}[{i}]", "not a [key, value] pair")
        k = _decode_aux(kv[0], None, path, f"{where}[{i}] key", depth + 1)
        _check(k is None or type(k) in (bool, int, float, str), path, f"{where}[{i}]", f"key {k!r} is not a scalar")
        out[k] = _decode_aux(kv[1], tensor, path, f"{where}[{k!r}]", depth + 1)
    return out


class _RecordFile:
    """A record file of a checkpoint, its size, index and every index entry checked when opened (against
    meta.json and the file itself); records are read (and crc-checked) one at a time. See [Note: checkpoint
    record files] and [Note: checkpoints are untrusted input]."""

    def __init__(self, path: str, want: dict | None, version: int = VERSION):
        self.path = path
        self.fd: int | None = None  # None once closed
        if want is None:
            raise CorruptionError("checkpoint file is not listed in meta.json", path)
        try:
            self.fd = own_open(path, os.O_RDONLY, what="open")  # a regular file, not through a symlink
        except TierstoreIOError as e:
            if e.errno == errno.ENOENT:
                raise CorruptionError("checkpoint file is missing", path) from None
            raise CorruptionError(f"checkpoint file cannot be opened ({e.strerror})", path) from None
        try:
            size = os.fstat(self.fd).st_size
            if size != want["nbytes"]:
                raise CorruptionError(f"checkpoint file is {size} bytes; meta.json says {want['nbytes']}", path)
            if size < len(MAGIC) + FOOTER.size or self._pread(0, len(MAGIC)) != MAGIC:
                raise CorruptionError(f"checkpoint file does not start with {MAGIC!r}", path, 0, len(MAGIC))
            at, n, crc, magic = FOOTER.unpack(self._pread(size - FOOTER.size, FOOTER.size))
            if magic != FOOTER_MAGIC or at < len(MAGIC) or at + n + FOOTER.size != size:
                raise CorruptionError("checkpoint file footer is damaged", path, size - FOOTER.size, FOOTER.size)
            raw = self._pread(at, n)
            if crc32c.crc32c(raw) != crc or crc != want["index_crc32c"]:
                raise CorruptionError(f"checkpoint file index fails its crc32c (footer {crc}, meta.json "
                                      f"{want['index_crc32c']}, data {crc32c.crc32c(raw)})", path, at, n)
            try:
                index = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise CorruptionError(f"checkpoint file index is not JSON ({e})", path, at, n) from None
            self._check_index(index, version, at)
            self.version = version
            self.records: dict[str, dict] = index["records"]
            self.aux: dict[str, Any] = index["aux"]  # JSON, checked by _check_index
            self.client: Any = index.get("client")  # {"state": tagged JSON} or None, checked by _check_index
        except BaseException:
            os.close(self.fd)
            self.fd = None
            raise

    def _check_index(self, index, version: int, end: int) -> None:
        p = self.path
        _check(isinstance(index, dict) and index.get("format") == FILE_FORMAT, p, "format",
               f"the index is not a {FILE_FORMAT!r} index")
        _check(index.get("version") == version, p, "version",
               f"the index says {index.get('version')!r}; meta.json says {version}")
        _check(index.get("byteorder") == "little", p, "byteorder", f"{index.get('byteorder')!r} is not 'little'")
        records, aux = index.get("records"), index.get("aux")
        _check(isinstance(records, dict), p, "records", "not a map of names to records")
        _check(isinstance(aux, dict) and all(isinstance(v, dict) and k.isdigit() and k.isascii()
                                             for k, v in aux.items()), p, "aux", "not a map of sub-groups to state")
        client = index.get("client")
        _check(client is None or isinstance(client, dict) and set(client) == {"state"}, p, "client",
               "not {\"state\": ...}")
        spans = []
        for name, r in records.items():
            f = f"records[{name!r}]"
            _check(isinstance(r, dict), p, f, "not a record")
            dt, shape = r.get("dtype"), r.get("shape")
            pickled = version == 2 and dt == "bytes" and name.endswith(".aux")  # refused by aux_of
            _check(isinstance(dt, str) and dt in _RECORD_DTYPES or pickled, p, f"{f}.dtype",
                   f"{dt!r} is not a dtype records hold")
            _check(isinstance(shape, list) and len(shape) <= 64 and all(_is_int(s) and s >= 0 for s in shape), p,
                   f"{f}.shape", f"{str(shape)[:80]} is not a shape")
            off, nb, crc = r.get("offset"), r.get("nbytes"), r.get("crc32c")
            _check(_is_int(nb) and nb == math.prod(shape) * (1 if pickled else _RECORD_DTYPES[dt].itemsize), p,
                   f"{f}.nbytes", f"{nb!r} is not {shape} x the itemsize of {dt}")
            _check(_is_int(off) and len(MAGIC) <= off and off + nb <= end, p, f"{f}.offset",
                   f"{off!r} + {nb} bytes is not between the magic and the index ({end})")
            _check(_is_int(crc) and 0 <= crc < 1 << 32, p, f"{f}.crc32c", f"{crc!r} is not a crc32c")
            if nb:
                spans.append((off, nb, name))
        spans.sort()
        for (a, an, aname), (b, _bn, bname) in zip(spans, spans[1:]):
            _check(a + an <= b, p, f"records[{bname!r}].offset", f"record overlaps {aname!r}")

    def _pread(self, offset: int, n: int) -> bytes:
        assert self.fd is not None  # read only while open
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise CorruptionError(f"checkpoint file ends early ({len(data)} of {n} bytes)", self.path, offset, n)
        return data

    def shape(self, name: str) -> tuple[int, ...] | None:
        r = self.records.get(name)
        return None if r is None else tuple(r["shape"])

    def read(self, name: str, numel: int | None = None) -> torch.Tensor:
        """Record `name` (crc-checked); numel: the elements it must have (checked before anything is read)."""
        r = self.records.get(name)
        if r is None:
            raise CorruptionError(f"checkpoint file has no record {name!r}", self.path)
        if r["dtype"] == "bytes":
            raise CorruptionError(f"checkpoint record {name!r} is not a tensor", self.path)
        if numel is not None and math.prod(r["shape"]) != numel:
            raise CorruptionError(f"checkpoint record {name!r} has shape {r['shape']}; the checkpoint's layout "
                                  f"says {numel} elements", self.path, r["offset"], r["nbytes"])
        at, n = r["offset"], r["nbytes"]
        buf = torch.empty(n, dtype=torch.uint8)
        view = buf.numpy().data  # a writable memoryview of buf
        assert self.fd is not None  # read only while open
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise CorruptionError(f"checkpoint record {name!r} is cut short ({done} of {n} bytes)", self.path,
                                      at, n)
            done += got
        if crc_at(buf.data_ptr(), n) != r["crc32c"]:
            raise CorruptionError(f"checkpoint record {name!r} fails its crc32c", self.path, at, n)
        return buf.view(_RECORD_DTYPES[r["dtype"]]).reshape(r["shape"])

    def aux_of(self, gid: int) -> dict:
        """Sub-group `gid`'s non-tensor optimizer state ([Note: checkpoints are untrusted input])."""
        if self.version == 2:
            if f"{gid}.aux" in self.records:
                raise TierstoreValueError(
                    f"{self.path} holds the optimizer state of sub-group {gid} as a pickle (record '{gid}.aux', "
                    "written by checkpoint format 2 for state JSON cannot hold); unpickling can run code, so "
                    "this tierstore does not read it. Convert a checkpoint you trust with the tierstore that "
                    f"wrote it: load_checkpoint, then save_checkpoint writes version {VERSION}")
            return dict(self.aux.get(str(gid), {}))
        j = self.aux.get(str(gid))
        if j is None:
            return {}
        out = _decode_aux(j, lambda k: self.read(f"{gid}.aux.{k}"), self.path, f"aux[{str(gid)!r}]")
        _check(type(out) is dict, self.path, f"aux[{str(gid)!r}]", "not a dict")
        return out

    def client_state(self) -> Any:
        """The client_state saved with this file (None when none was), decoded ([Note: client state])."""
        if self.client is None:
            return None
        return _decode_aux(self.client["state"], lambda k: self.read(f"client.{k}"), self.path, "client")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Checkpoint:
    """The files of one checkpoint, opened on first use; ``record`` keeps the last source sub-group read."""

    def __init__(self, sub: str, body: dict):
        self.sub = sub
        self.body = body
        self.version = body["version"]
        self._open: dict[str, _RecordFile] = {}
        self._last_key: tuple[int, int] | None = None
        self._last: dict[str, torch.Tensor] = {}

    def file(self, fname: str) -> _RecordFile:
        if fname not in self._open:
            self._open[fname] = _RecordFile(os.path.join(self.sub, fname), self.body["files"].get(fname),
                                            self.version)
        return self._open[fname]

    def rank(self, r: int) -> _RecordFile:
        return self.file(f"rank{r:05d}.bin")

    def buffers(self) -> dict[str, torch.Tensor]:
        f = self.file("buffers.bin")
        return {n: f.read(n) for n in f.records}

    def record(self, r: int, gid: int, role: str, numel: int) -> torch.Tensor:
        """Record ``<gid>.<role>`` of rank r's file, of `numel` elements; the records of one (rank, gid) stay
        cached until another (rank, gid) is read, so memory holds one source sub-group ([Note: streaming save
        and load])."""
        if self._last_key != (r, gid):
            self._last_key, self._last = (r, gid), {}
        if role not in self._last:
            self._last[role] = self.rank(r).read(f"{gid}.{role}", numel)
        return self._last[role]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
        self._last = {}


def _source_layout(body: dict) -> list[tuple[int, Plan, list[int]]]:
    """(group index, plan, gids) per group of the saved layout."""
    out, gid = [], 0
    for g in body["layout"]["groups"]:
        p = Plan.from_dict(g["plan"])
        if not _is_int(g["index"]):
            raise TierstoreValueError(f"group index {g['index']!r} is not an integer")
        out.append((g["index"], p, list(range(gid, gid + len(p.buckets)))))
        gid += len(p.buckets)
    return out


def _assemble(ck: _Checkpoint, src: Plan, dst: Plan, s_gids: list[int], rank: int, roles: list[str],
              dtype: torch.dtype, device, has: dict[int, list[str]] | None = None, fill=None):
    """Yield (destination bucket, {role: this rank's shard}, [source buckets it draws on, in order]) one bucket
    at a time, each shard built from the source records ``<src gid>.<role>`` of every source rank it overlaps.
    has[source bucket] -> the roles that source has records for (default: all); a role none of the sources
    of the destination bucket (on any rank, so every rank of it agrees) holds is left out of its dict, and
    elements of a role from a source without it are fill[role] (default 0). See [Note: streaming save and
    load]."""
    by_dst: dict[int, list] = {}  # this rank's copies
    srcs_of: dict[int, list[int]] = {}  # source buckets of every rank's shard of the destination bucket
    for c in reshard_copies(src, dst):  # sorted by source: model order
        if c.dst_rank == rank:
            by_dst.setdefault(c.dst_bucket, []).append(c)
        if c.src_bucket not in srcs_of.setdefault(c.dst_bucket, []):
            srcs_of[c.dst_bucket].append(c.src_bucket)
    fill = fill or {}
    for b in dst.buckets:
        copies = by_dst.get(b.index, [])
        srcs = srcs_of.get(b.index, [])
        present = {r for sb in srcs for r in (has[sb] if has is not None else roles)}
        out = {role: torch.full((b.shard_numel,), fill.get(role, 0.0), dtype=dtype, device=device)
               for role in roles if role in present}
        for c in copies:
            for role in (has[c.src_bucket] if has is not None else roles):
                if role in out:
                    s = ck.record(c.src_rank, s_gids[c.src_bucket], role, src.buckets[c.src_bucket].shard_numel)
                    out[role][c.dst_offset:c.dst_offset + c.numel].copy_(
                        s.reshape(-1)[c.src_offset:c.src_offset + c.numel])
        yield b.index, out, srcs
        del out  # before the next bucket's: one destination sub-group at a time


def load_checkpoint(opt, directory: str | os.PathLike) -> Any:
    """Load the latest checkpoint in `directory` into `opt` (every rank calls it), resharding to this world
    size and layout, one sub-group at a time; returns this rank's client_state ([Note: client state]). See
    [Note: resharding on load]. A load that fails leaves `opt` as it was, or unusable, saying so ([Note: a
    failed load changes nothing] in ckpt_verify.py)."""
    ckpt_args.optimizer(opt, "load_checkpoint", usable=False)  # a load is what makes an unusable one whole
    directory = ckpt_args.directory(directory, "load_checkpoint")
    got: dict[str, Any] = {}  # read in the first pass: inside it, a rank that cannot read them fails every rank

    def plan():
        if not got:
            sub, body = read_meta(directory)
            got["ck"] = ck = _Checkpoint(sub, body)
            got["client"] = ck.rank(opt.rank if opt.rank < body["world_size"] else 0).client_state()
        return _load(opt, got["ck"], got["ck"].body)
    try:
        ckpt_verify.verify_then_import(opt, plan, lambda item: _import(opt, item))
    finally:
        if "ck" in got:
            got["ck"].close()
        if opt.unusable is not None:  # partly loaded: what is gathered may be from before
            opt.coordinator.release_all()
    opt.zero_grad()
    opt.coordinator.release_all()
    _dist.barrier(opt.group)
    return got["client"]


def _import(opt, item: tuple) -> None:
    """Put one item _load yields into the optimizer."""
    kind = item[0]
    if kind == "param":
        _k, gid, shard = item
        opt.store.put(keys.param(gid), shard.to(opt.device, opt.config.compute_dtype), tier=opt.config.params)
    elif kind == "subgroup":
        _k, gid, master, state, aux = item
        opt.import_subgroup(gid, master, state, aux)
    elif kind == "buffer":
        _k, b, value = item
        b.data.copy_(value.to(b.dtype))
    else:  # "meta"
        body = item[1]
        opt.set_hyperparams(body["param_groups"])
        opt.load_scaler_state(body["scaler"])
        opt.steps = body["steps"]


def _load(opt, ck: _Checkpoint, body: dict):
    """Yield what loading the checkpoint into `opt` imports, one item at a time, every record read (and
    crc-checked) before the item it belongs to; `opt` is only read: ("param", gid, fp32 shard) of a frozen
    sub-group, ("subgroup", gid, master, states, aux), ("buffer", the model's buffer, value), ("meta", body)
    for the hyperparameters, loss scaler and steps. See [Note: a failed load changes nothing]."""
    src = _source_layout(body)
    if len(src) != len(opt.layout.groups):
        raise TierstoreValueError(f"the checkpoint has {len(src) - 1} parameter groups; this optimizer has "
                                  f"{len(opt.layout.groups) - 1}")
    me = opt.rank
    # checked before anything is yielded: hyperparameters, the buffers' shapes, every sub-group's aux state
    meta = os.path.join(ck.sub, "meta.json")
    _check_hyperparams(opt.param_groups, body["param_groups"], meta)
    if "frozen" in body:  # [Note: frozen parameters left out of a checkpoint]
        frozen_ckpt.check(opt, body["frozen"], body["compute_dtype"], meta)
    bfile = ck.file("buffers.bin")
    for n, b in opt.model.named_buffers():
        shape = bfile.shape(n)  # None: the checkpoint has no such buffer
        if shape is not None and shape != tuple(b.shape):
            raise TierstoreValueError(f"buffer {n!r} has shape {list(shape)} in {bfile.path} and "
                                      f"{list(b.shape)} in the model; build the same model")
    first = ck.rank(0)
    aux = {sg: first.aux_of(sg) for s_index, _p, s_gids in src if s_index >= 0 for sg in s_gids}
    for (s_index, s_plan, _g), gl in zip(src, opt.layout.groups):
        if s_index != gl.index or set(s_plan.params) != set(gl.plan.params):
            raise TierstoreValueError(f"parameter group {gl.index} holds other parameters in the checkpoint "
                                      f"({sorted(set(s_plan.params) ^ set(gl.plan.params))[:3]} differ); build "
                                      f"the same model and param_groups")
    for (_i, s_plan, s_gids), gl in zip(src, opt.layout.groups):
        if not gl.gids:
            continue
        if not gl.trainable and "frozen" in body:  # left out (checked above): the model's own values stay
            continue
        if not gl.trainable:
            # over fp32 twins too, so the compute dtype may differ from the saving run's
            for b, shard, _srcs in _assemble(ck, fp32_twin(s_plan), fp32_twin(gl.plan), s_gids, me, ["param"],
                                             torch.float32, "cpu"):
                yield "param", gl.gids[b], shard["param"]
            continue
        # per source sub-group: which states are per element (resharded) and which scalar; a sub-group no
        # step reached has none, and sub-groups skipped on some steps count their own `step`
        # ([Note: resharding on load])
        per_element: dict[int, list[str]] = {}
        scalars: dict[int, dict] = {}
        for sb, sg in enumerate(s_gids):
            names = [n[len(f"{sg}.state."):] for n in first.records if n.startswith(f"{sg}.state.")]
            per_element[sb] = [k for k in names
                               if first.shape(f"{sg}.state.{k}") == (s_plan.buckets[sb].shard_numel,)]
            scalars[sb] = {k: first.read(f"{sg}.state.{k}") for k in names if k not in per_element[sb]}
        all_keys = list(dict.fromkeys(k for sb in per_element for k in per_element[sb]))
        fresh = opt.initial_state_values(gl.gids[0])
        roles = ["master"] + [f"state.{k}" for k in all_keys]
        for b, shards, srcs in _assemble(
                ck, fp32_twin(s_plan), fp32_twin(gl.plan), s_gids, me, roles, torch.float32, "cpu",
                has={sb: ["master"] + [f"state.{k}" for k in ks] for sb, ks in per_element.items()},
                fill={f"state.{k}": fresh.get(k, 0.0) for k in all_keys}):
            st = {k: shards[f"state.{k}"] for k in all_keys if f"state.{k}" in shards}
            stepped = [sb for sb in srcs if per_element[sb] or scalars[sb] or aux[s_gids[sb]]]
            if stepped:  # scalars of the first source sub-group that was stepped (all of them agree when
                st.update({k: v.clone() for k, v in scalars[stepped[0]].items()})  # the layouts match)
            yield "subgroup", gl.gids[b], shards["master"], st, aux[s_gids[stepped[0]]] if stepped else {}
            del shards, st
    for n, b in opt.model.named_buffers():  # one at a time
        if n in bfile.records:
            yield "buffer", b, bfile.read(n)
    yield "meta", body


def _kind(v) -> str:
    if isinstance(v, torch.Tensor):
        return "number" if v.numel() == 1 else "sequence"
    if isinstance(v, bool) or isinstance(v, str) or isinstance(v, dict):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    return "sequence" if isinstance(v, (list, tuple)) else type(v).__name__


def _check_hyperparams(groups: list[dict], saved: list[dict], path: str) -> None:
    """Each saved hyperparameter must be of the kind (number, bool, str, sequence) the optimizer holds."""
    for i, (g, sv) in enumerate(zip(groups, saved)):
        for k, v in sv.items():
            cur = g.get(k)
            _check(cur is None or v is None or _kind(cur) == _kind(v), path, f"param_groups[{i}][{k!r}]",
                   f"{str(v)[:40]} is a {_kind(v)}; the optimizer's is a {_kind(cur)}")


def consolidate(directory: str | os.PathLike, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model of the latest checkpoint in `directory` as a plain state_dict (every parameter name,
    tied aliases included, and the buffers), for torch.save / safetensors. Runs in one process.

    dtype: of the parameters (default: the compute dtype of the run that saved it; float32 gives the
    masters themselves)."""
    dtype = ckpt_args.dtype(dtype)
    directory = ckpt_args.directory(directory, "consolidate")
    for _attempt in range(ckpt_dir.RETRIES):
        sub, body = read_meta(directory)
        try:
            return _consolidate(sub, body, dtype)
        except CorruptionError as e:  # a file gone because a writer pruned the checkpoint is not damage
            if not ckpt_dir.vanished(directory, sub, e.filename):  # ([Note: readers and a concurrent cleanup])
                raise
    raise ckpt_dir.removed_error(directory, sub)


def _consolidate(sub: str, body: dict, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    ck = _Checkpoint(sub, body)
    try:
        world = body["world_size"]
        cdt = getattr(torch, body["compute_dtype"])
        values: dict[str, torch.Tensor] = {}
        for index, plan, gids in _source_layout(body):
            if index < 0 and "frozen" in body:  # [Note: frozen parameters left out of a checkpoint]
                continue
            role = "master" if index >= 0 else "param"
            buckets = []
            for b, gid in enumerate(gids):
                n = plan.buckets[b].shard_numel  # elements
                full = torch.cat([ck.record(r, gid, role, n).reshape(-1).to(torch.float32) for r in range(world)])
                buckets.append(full.to(plan.buckets[b].dtype) if index < 0 else full)
            if index >= 0:
                plan = fp32_twin(plan)
            for name, t in plan.unflatten(buckets).items():
                values[name] = t.to(dtype or cdt)
        out = {alias: values[canon] for alias, canon in body["aliases"].items() if canon in values}
        out.update(ck.buffers())
        return out
    finally:
        ck.close()


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
