"""A checkpoint's record files (``rank<r>.bin``, ``buffers.bin``): their on-disk layout, written front to back
(RecordWriter) and read back by random access with every field and crc32c checked (RecordFile, and Checkpoint
for the files of one checkpoint); the tagged JSON that holds non-tensor state in a file's index.

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
(the k-th tensor of the client state, [Note: client state] in save.py); in buffers.bin
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

[Note: checkpoints are untrusted input]
A checkpoint directory may come from anywhere (a shared filesystem, a download), and a crc32c protects
against damage, not against whoever wrote the file: they compute it too. So nothing in a checkpoint is
executed or unpickled, and every field is checked before it is used to open, allocate or index anything:
`latest` must be a plain name in the directory (``ckpt-<steps>-<hex>``), meta.json's fields their types and
ranges, each record's place inside its file before the index, no two records overlapping, nbytes equal to
prod(shape) x itemsize of a known dtype, and the records a load uses of the size the layout says. A
malformed file is a CorruptionError naming the file and the field. The optimizer's non-tensor state (the
"aux" of a sub-group) is written in tagged JSON (see encode_aux); types it cannot hold are refused when
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
import struct
import sys
from typing import Any, NoReturn, TypeGuard

import crc32c
import torch

from ...errors import CorruptionError, TierstoreIOError, TierstoreValueError
from ...io.checksum import crc_at, memory_at
from ...io.files import fsync_dir, own_open
from ...manifest import STORED_DTYPES

VERSION = 3  # the format version of the files a save writes (and of meta.json, meta.py)
FILE_FORMAT = "tierstore.zero.checkpoint.records"
MAGIC = b"TSZCKPT2"
FOOTER = struct.Struct("<QQI4s")  # index_offset, index_nbytes, index crc32c, b"TSZI"
FOOTER_MAGIC = b"TSZI"
_AUX_TAGS = ("tuple", "dict", "float", "tensor")
_AUX_DEPTH = 64  # nesting levels of aux state
RECORD_DTYPES = STORED_DTYPES  # dtypes a record may hold


def is_int(v: object) -> TypeGuard[int]:
    """Whether a field read from a checkpoint is an int (a count, offset or size)."""
    return type(v) is int  # bool is not a count, offset or size


def corrupt(path: str, field: str, what: str) -> NoReturn:
    """The CorruptionError of a malformed field of a checkpoint file."""
    raise CorruptionError(f"checkpoint file field {field}: {what}; the file is damaged or was not written "
                          "by tierstore: load an older checkpoint", path)


def check(ok: bool, path: str, field: str, what: str) -> None:
    """corrupt(path, field, what) unless `ok`."""
    if not ok:
        corrupt(path, field, what)



def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _record_dtype_name(dt: torch.dtype) -> str:
    name = _dtype_name(dt)
    if RECORD_DTYPES.get(name) != dt:
        raise TierstoreValueError(f"a checkpoint record cannot hold dtype {dt}; it holds "
                                  f"{', '.join(RECORD_DTYPES)}")
    return name


class RecordWriter:
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
        enc = encode_aux(dict(aux), tensors, f"optimizer state of sub-group {gid}")
        for k, t in enumerate(tensors):
            self.tensor(f"{gid}.aux.{k}", t)
        self.aux[str(gid)] = enc

    def set_client(self, encoded: tuple[Any, list[torch.Tensor]]) -> None:
        """The caller's client_state as encode_client gave it (tagged JSON, its tensors as records
        ``client.<k>``). See [Note: client state] in save.py."""
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


def encode_aux(v, tensors: list, where: str, depth: int = 0):
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
        return [encode_aux(x, tensors, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if t is tuple:
        return {"tuple": [encode_aux(x, tensors, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
    if t is dict:
        out = []
        for k, x in v.items():
            if k is not None and type(k) not in (bool, int, float, str):
                raise TierstoreValueError(f"{where} has a key of type {type(k).__name__}; "
                                          "checkpoints store keys that are None, bool, int, float or str")
            out.append([encode_aux(k, tensors, where, depth + 1), encode_aux(x, tensors, f"{where}[{k!r}]",
                                                                                depth + 1)])
        return {"dict": out}
    hint = (" (numpy's RNG: tierstore.zero.rng_state() gives every RNG's state in these types; an array: "
            "torch.from_numpy(a))" if t.__module__ == "numpy" else "")
    raise TierstoreValueError(
        f"{where} is a {t.__module__}.{t.__qualname__}; checkpoints store non-tensor state of types None, bool, "
        "int, float, str, list, tuple, dict and torch.Tensor only (nothing is pickled, so loading a checkpoint "
        f"cannot run code): keep it in those types{hint}")


def decode_aux(j, tensor, path: str, where: str, depth: int = 0):
    """The inverse of encode_aux; tensor(k) reads the k-th tensor. CorruptionError on anything else."""
    if depth > _AUX_DEPTH:
        check(False, path, where, f"nested more than {_AUX_DEPTH} levels deep")
    if j is None or type(j) in (bool, int, float, str):
        return j
    if type(j) is list:
        return [decode_aux(x, tensor, path, f"{where}[{i}]", depth + 1) for i, x in enumerate(j)]
    check(type(j) is dict and len(j) == 1 and next(iter(j)) in _AUX_TAGS, path, where,
           f"{str(j)[:80]} is not tagged aux state")
    (tag, x), = j.items()
    if tag == "float":
        check(x in ("nan", "inf", "-inf"), path, where, f"{x!r} is not nan, inf or -inf")
        return float(x)
    if tag == "tensor":
        check(is_int(x) and x >= 0, path, where, f"{x!r} is not a tensor number")
        return tensor(x)
    check(type(x) is list, path, where, f"{tag} of {type(x).__name__}, not a list")
    if tag == "tuple":
        return tuple(decode_aux(y, tensor, path, f"{where}[{i}]", depth + 1) for i, y in enumerate(x))
    out = {}
    for i, kv in enumerate(x):
        check(type(kv) is list and len(kv) == 2, path, f"{where}[{i}]", "not a [key, value] pair")
        k = decode_aux(kv[0], None, path, f"{where}[{i}] key", depth + 1)
        check(k is None or type(k) in (bool, int, float, str), path, f"{where}[{i}]", f"key {k!r} is not a scalar")
        out[k] = decode_aux(kv[1], tensor, path, f"{where}[{k!r}]", depth + 1)
    return out



def encode_client(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """client_state as tagged JSON and the tensors in it; TierstoreValueError for a type it cannot hold."""
    tensors: list[torch.Tensor] = []
    return encode_aux(state, tensors, "client_state"), tensors



class RecordFile:
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
        check(isinstance(index, dict) and index.get("format") == FILE_FORMAT, p, "format",
               f"the index is not a {FILE_FORMAT!r} index")
        check(index.get("version") == version, p, "version",
               f"the index says {index.get('version')!r}; meta.json says {version}")
        check(index.get("byteorder") == "little", p, "byteorder", f"{index.get('byteorder')!r} is not 'little'")
        records, aux = index.get("records"), index.get("aux")
        check(isinstance(records, dict), p, "records", "not a map of names to records")
        check(isinstance(aux, dict) and all(isinstance(v, dict) and k.isdigit() and k.isascii()
                                             for k, v in aux.items()), p, "aux", "not a map of sub-groups to state")
        client = index.get("client")
        check(client is None or isinstance(client, dict) and set(client) == {"state"}, p, "client",
               "not {\"state\": ...}")
        spans = []
        for name, r in records.items():
            f = f"records[{name!r}]"
            check(isinstance(r, dict), p, f, "not a record")
            dt, shape = r.get("dtype"), r.get("shape")
            pickled = version == 2 and dt == "bytes" and name.endswith(".aux")  # refused by aux_of
            check(isinstance(dt, str) and dt in RECORD_DTYPES or pickled, p, f"{f}.dtype",
                   f"{dt!r} is not a dtype records hold")
            check(isinstance(shape, list) and len(shape) <= 64 and all(is_int(s) and s >= 0 for s in shape), p,
                   f"{f}.shape", f"{str(shape)[:80]} is not a shape")
            off, nb, crc = r.get("offset"), r.get("nbytes"), r.get("crc32c")
            check(is_int(nb) and nb == math.prod(shape) * (1 if pickled else RECORD_DTYPES[dt].itemsize), p,
                   f"{f}.nbytes", f"{nb!r} is not {shape} x the itemsize of {dt}")
            check(is_int(off) and len(MAGIC) <= off and off + nb <= end, p, f"{f}.offset",
                   f"{off!r} + {nb} bytes is not between the magic and the index ({end})")
            check(is_int(crc) and 0 <= crc < 1 << 32, p, f"{f}.crc32c", f"{crc!r} is not a crc32c")
            if nb:
                spans.append((off, nb, name))
        spans.sort()
        for (a, an, aname), (b, _bn, bname) in zip(spans, spans[1:]):
            check(a + an <= b, p, f"records[{bname!r}].offset", f"record overlaps {aname!r}")

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
        return buf.view(RECORD_DTYPES[r["dtype"]]).reshape(r["shape"])

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
        out = decode_aux(j, lambda k: self.read(f"{gid}.aux.{k}"), self.path, f"aux[{str(gid)!r}]")
        check(type(out) is dict, self.path, f"aux[{str(gid)!r}]", "not a dict")
        return out

    def client_state(self) -> Any:
        """The client_state saved with this file (None when none was), decoded ([Note: client state] in
        save.py)."""
        if self.client is None:
            return None
        return decode_aux(self.client["state"], lambda k: self.read(f"client.{k}"), self.path, "client")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Checkpoint:
    """The files of one checkpoint, opened on first use; ``record`` keeps the last source sub-group read."""

    def __init__(self, sub: str, body: dict):
        self.sub = sub
        self.body = body
        self.version = body["version"]
        self._open: dict[str, RecordFile] = {}
        self._last_key: tuple[int, int] | None = None
        self._last: dict[str, torch.Tensor] = {}

    def file(self, fname: str) -> RecordFile:
        if fname not in self._open:
            self._open[fname] = RecordFile(os.path.join(self.sub, fname), self.body["files"].get(fname),
                                            self.version)
        return self._open[fname]

    def rank(self, r: int) -> RecordFile:
        return self.file(f"rank{r:05d}.bin")

    def buffers(self) -> dict[str, torch.Tensor]:
        f = self.file("buffers.bin")
        return {n: f.read(n) for n in f.records}

    def record(self, r: int, gid: int, role: str, numel: int) -> torch.Tensor:
        """Record ``<gid>.<role>`` of rank r's file, of `numel` elements; the records of one (rank, gid) stay
        cached until another (rank, gid) is read, so memory holds one source sub-group ([Note: streaming save
        and load] in load.py)."""
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

