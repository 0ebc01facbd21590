"""A checkpoint's meta.json, its table of contents: the document a save writes last (encode, write_atomic --
which replaces ``latest`` too), and read_meta, which finds the latest checkpoint of a directory and checks
meta.json field by field before a load or consolidate uses any of it ([Note: checkpoints are untrusted input]
in records.py); source_layout, the partition layout it records."""
from __future__ import annotations

import errno
import json
import os

import crc32c
import torch

from ...errors import CorruptionError, TierstoreIOError, TierstoreValueError
from ...io.files import fsync_dir, own_open, read_small
from ...partition import Plan
from . import directory as ckpt_dir
from .directory import LATEST
from .records import RECORD_DTYPES, VERSION, check, corrupt, is_int

FORMAT = "tierstore.zero.checkpoint"
READABLE = (2, 3)  # versions load_checkpoint / consolidate read (2: aux state as plain JSON, no pickled records)
_META_MAX = 256 << 20  # bytes of meta.json: the layout lists every parameter (~1 KB each), 200k+ of them


def write_atomic(path: str, data: bytes) -> None:
    """`path` (meta.json, `latest`) replaced by `data` (temp, fsync, rename, fsync dir); neither name may be a
    symlink ([Note: tierstore's own files] in io/files.py)."""
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


def body_crc(body: dict) -> int:
    """The crc32c meta.json carries of its body (of the body's canonical JSON)."""
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def encode(body: dict) -> bytes:
    """meta.json's bytes for `body`, which gets the format version (under the crc32c from version 3)."""
    body["version"] = VERSION
    doc = {"format": FORMAT, "version": VERSION, "crc32c": body_crc(body), "body": body}
    return json.dumps(doc, indent=1).encode()


def read_meta(directory: str | os.PathLike) -> tuple[str, dict]:
    """(checkpoint subdirectory, meta body) of the latest checkpoint in `directory`, checked field by field
    ([Note: checkpoints are untrusted input] in records.py); the body's "version" is the format version
    of its files."""
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
                continue  # ([Note: readers and a concurrent cleanup] in directory.py)
            raise CorruptionError(f"{LATEST!r} names {name}, which has no meta.json; write the name of the newest "
                                  "complete ckpt-* directory into it", path) from None
        except (ValueError, RecursionError) as e:
            raise CorruptionError(f"checkpoint metadata unreadable: {e}", path) from None
    else:
        raise ckpt_dir.removed_error(directory, sub)
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or doc.get("format") != FORMAT or not is_int(doc.get("crc32c")) \
            or doc["crc32c"] != body_crc(body):
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
    check("version" in body or version == 2, path, "version", f"version {version} must be inside the body")
    _check_body(body, path)
    return sub, {**body, "version": version}


def _check_body(body: dict, path: str) -> None:
    """Every field of meta.json's body that a load or consolidate uses, before anything is read or made."""
    world = body.get("world_size")
    if not (is_int(world) and world >= 1):  # narrows world to int below
        corrupt(path, "world_size", f"{world!r} is not a positive integer")
    try:
        src = source_layout(body)
    except (TierstoreValueError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise CorruptionError(f"checkpoint file field layout: {e}; the file is damaged: load an older checkpoint",
                              path) from None
    indices = [i for i, _p, _g in src]
    check(indices == list(range(len(src) - 1)) + [-1], path, "layout.groups",
           f"group indices {indices} are not 0, 1, ... then -1 (the frozen parameters)")
    check(all(p.world_size == world for _i, p, _g in src), path, "layout", f"a plan is not for {world} ranks")
    groups = body.get("param_groups")
    check(isinstance(groups, list) and len(groups) == len(src) - 1
           and all(isinstance(g, dict) for g in groups), path, "param_groups",
           f"not one dict per parameter group ({len(src) - 1})")
    check(isinstance(body.get("optimizer"), str), path, "optimizer", "not a string")
    check(isinstance(RECORD_DTYPES.get(str(body.get("compute_dtype"))), torch.dtype)
           and RECORD_DTYPES[body["compute_dtype"]].is_floating_point, path, "compute_dtype",
           f"{body.get('compute_dtype')!r} is not a floating dtype")
    steps = body.get("steps")
    check(is_int(steps) and steps >= 0, path, "steps", f"{steps!r} is not a count")
    sc = body.get("scaler")
    check(isinstance(sc, dict) and type(sc.get("scale")) in (int, float) and is_int(sc.get("good"))
           and is_int(sc.get("skipped")), path, "scaler", f"{sc!r} is not {{scale, good, skipped}}")
    params = {n for _i, p, _g in src for n in p.params}
    al = body.get("aliases")
    check(isinstance(al, dict) and all(isinstance(v, str) and v in params for v in al.values()), path,
           "aliases", "not a map of names to parameters of the layout")
    files = body.get("files")
    want = {f"rank{r:05d}.bin" for r in range(world)} | {"buffers.bin"} if world <= 1 << 20 else set()
    if not (isinstance(files, dict) and set(files) == want):  # narrows files to dict below
        corrupt(path, "files", f"does not list rank00000.bin ... rank{world - 1:05d}.bin and buffers.bin")
    for f, w in files.items():
        check(isinstance(w, dict) and is_int(w.get("nbytes")) and w["nbytes"] >= 0
               and is_int(w.get("index_crc32c")) and 0 <= w["index_crc32c"] < 1 << 32, path, f"files[{f!r}]",
               f"{w!r} is not {{nbytes, index_crc32c}}")



def source_layout(body: dict) -> list[tuple[int, Plan, list[int]]]:
    """(group index, plan, gids) per group of the saved layout."""
    out, gid = [], 0
    for g in body["layout"]["groups"]:
        p = Plan.from_dict(g["plan"])
        if not is_int(g["index"]):
            raise TierstoreValueError(f"group index {g['index']!r} is not an integer")
        out.append((g["index"], p, list(range(gid, gid + len(p.buckets)))))
        gid += len(p.buckets)
    return out

