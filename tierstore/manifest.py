"""The manifest: the one file naming every tensor of a store's last completed flush (manifest.json in the
first directory). Its format constants, reading and validating it, and writing it crash-safely.

[Note: the manifest is untrusted input]
The crc32c catches damage, not a manifest someone wrote on purpose (they compute it too). So `Store.open`
checks every field before it creates, allocates or reads anything: types and ranges, shape x dtype itemsize
== nbytes (== the extent's length for raw bytes), a known dtype, a codec that decodes to numbers (numcodecs'
pickle and object codecs are refused: decoding them would unpickle or build Python objects), 4 KiB-aligned
extents of align_up(length) bytes inside extent files that exist in every directory, no two extents
overlapping, and ndirs / stripe_unit as opened. A malformed manifest is a CorruptionError naming the file
and the field. An extent reaching past the end of its (truncated) file damages that tensor only: reading
it is a CorruptionError naming it, raised before any memory is allocated for it. The version is also
written inside the checksummed body (manifests from before that keep it outside only, and still open).

[Note: how large a manifest can be]
A manifest is read whole, so its size is capped before anything is read (only a regular file is read:
[Note: tierstore's own files] in io/files.py), by what the format can need: an entry names one tensor,
and every tensor with bytes holds at least one 4 KiB block of the extent files. So a manifest may take
MANIFEST_BASE_BYTES (the envelope, tensors without bytes) plus MANIFEST_BYTES_PER_BLOCK per 4 KiB of extent
files -- several times what an entry with a name of a few hundred characters takes. A larger file is not a
manifest of these extent files and is refused by its size, before a byte of it is parsed (so a 1 GB file
next to small extent files costs nothing); flush() refuses to write one a reopen would refuse. Nesting is
bounded by Python's recursion limit (a RecursionError while parsing is a CorruptionError).
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import stat
from collections.abc import Iterator
from typing import NamedTuple

import crc32c
import torch

from .encoding import IDENTITY, codec_config, codec_from_config, dtype_name
from .errors import CorruptionError, TierstoreIOError, TierstoreValueError, io_error
from .io.files import ALIGN, own_open, read_small
from .tiers import Extent, profile_range
from .tiers.nvme import EXTENT_FILE

MANIFEST = "manifest.json"
FORMAT = "tierstore-manifest"
VERSION = 1
STORED_DTYPES: dict[str, torch.dtype] = {  # dtypes a manifest (and a checkpoint record) may name
    n: getattr(torch, n) for n in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8",
        "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz") if isinstance(getattr(torch, n, None), torch.dtype)}
_ITEMSIZE = {n: dt.itemsize for n, dt in STORED_DTYPES.items()}  # bytes per element, by dtype name
OBJECT_CODECS = ("pickle", "json2", "msgpack2", "vlen-utf8", "vlen-bytes", "vlen-array")  # numcodecs ids
MANIFEST_BASE_BYTES = 32 << 20  # a manifest may need this much whatever the extent files hold ...
MANIFEST_BYTES_PER_BLOCK = 512  # ... plus this much per 4 KiB of extent files
_HEAD = re.compile(rb'\{"format":"' + FORMAT.encode() + rb'","version":[0-9]{1,9},"crc32c":[0-9]{1,10},"body":')
_EXTENT_NAME = re.compile(r"extents-[0-9]{4,}\.bin")


class Entry(NamedTuple):
    """One tensor a manifest names, its fields checked."""

    name: str
    shape: list
    dtype: torch.dtype
    codec: object
    extent: Extent
    nbytes: int  # bytes, decoded


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside the block (as it was after it); see [Note: opening costs what
    the tensors need]."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _field(name: str) -> str:
    """How errors name the manifest entry of tensor `name` (built only for an error)."""
    return f"tensors[{name!r}]"


def _manifest_crc(body: dict) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _corrupt(path: str, field: str, what: str) -> CorruptionError:
    return CorruptionError(f"the manifest {path}: field {field}: {what}; it is damaged or was not written by "
                           "tierstore: restore it from a backup", path)


def manifest_limit(extent_bytes: int) -> int:
    """The most bytes a manifest can need in a store whose extent files hold `extent_bytes` (all parts of all
    directories together); see [Note: how large a manifest can be]."""
    return MANIFEST_BASE_BYTES + extent_bytes // ALIGN * MANIFEST_BYTES_PER_BLOCK


def extent_bytes_in(directories: list[str]) -> int:
    """The bytes of the extent files (regular files only) in `directories`, for manifest_limit."""
    total = 0
    for d in directories:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if _EXTENT_NAME.fullmatch(name):
                try:
                    st = os.lstat(os.path.join(d, name))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def read_manifest(directory: str, limit: int | None = None) -> dict | None:
    """The manifest body in `directory`, None when there is none. CorruptionError when unreadable; the fields
    are checked by parse_body ([Note: the manifest is untrusted input]). Only a regular file is read, and only
    up to `limit` bytes (default: manifest_limit of the extent files in `directory`; a Store passes those of
    all its directories) -- see [Note: how large a manifest can be]."""
    path = os.path.join(directory, MANIFEST)
    if limit is None:
        limit = manifest_limit(extent_bytes_in([directory]))
    try:
        raw = read_small(path, limit, what="read the manifest")
    except TierstoreIOError as e:
        if e.errno == errno.ENOENT:
            return None
        if e.errno == errno.EFBIG:
            raise CorruptionError(f"the manifest {path} is {e.length} bytes, more than a store whose extent files "
                                  f"hold what these do can need ({limit} bytes); it is damaged or was not written "
                                  "by tierstore: restore it from a backup", path, 0, e.length) from None
        raise
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # nesting deeper than Python's recursion limit: RecursionError
        raise CorruptionError(f"the manifest {path} is not valid ({str(e)[:200]}); restore it from a backup",
                              path) from None
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"the manifest {path} is not a {FORMAT!r} document (or its body is not a dict); "
                              "restore it from a backup", path)
    if type(doc.get("crc32c")) is not int or not _crc_matches(raw, body, doc["crc32c"]):
        raise CorruptionError(f"the manifest {path} fails its checksum; restore it from a backup", path)
    version = doc.get("version")
    if "version" in body and body["version"] != version:  # written under the checksum since it was added
        raise _corrupt(path, "version", f"{version!r} outside the checksummed body, {body['version']!r} inside")
    if type(version) is not int or version < 1:
        raise _corrupt(path, "version", f"{version!r} is not a version")
    if version > VERSION:
        raise TierstoreValueError(f"{path} has format version {version}; this tierstore reads "
                                  f"<= {VERSION}: upgrade tierstore")
    return body


def _crc_matches(raw: bytes, body: dict, crc: int) -> bool:
    """Whether `body` (parsed from the manifest text `raw`) has checksum `crc`.

    The checksum covers the body's canonical JSON. write_manifest puts exactly that text after the
    document's head, so the bytes there are checked as they are; only a manifest laid out otherwise (or
    damaged) costs serialising the body again."""
    head = _HEAD.match(raw, 0, 128)
    if head is not None and raw.endswith(b"}") and crc32c.crc32c(memoryview(raw)[head.end():-1]) == crc:
        return True
    return _manifest_crc(body) == crc


def parse_body(body: dict, where: str, ndirs: int, stripe_unit: int) -> tuple[int, list[Entry]]:
    """The generation and the tensors of a manifest body, every field checked except the extents against the
    files (the persistent tier's check_extents does that) ([Note: the manifest is untrusted input]).
    `where` names the manifest in errors; ndirs and stripe_unit are the store's as opened. Consumes
    body["tensors"] (each entry is dropped once parsed, so the parse holds the JSON or the result, not both).

    [Note: opening costs what the tensors need]
    Opening a store of a million tensors is dominated by the per-entry work, so each entry is checked in
    one pass of plain comparisons (no per-entry string building: the field names of errors are made only for
    an error), its JSON dropped as soon as its records exist, and the checksum computed over the bytes as
    read instead of a second serialisation. And the cyclic garbage collector is paused meanwhile
    (gc_paused): the parse creates millions of objects and no cycles, and each collection it would
    otherwise trigger walks every object created so far -- about half of the time of a large open."""
    for f in ("generation", "ndirs", "stripe_unit"):
        if type(body.get(f)) is not int or body[f] < (0 if f == "generation" else 1):
            raise _corrupt(where, f, f"{body.get(f)!r} is not a positive integer")
    if body["ndirs"] != ndirs or body["stripe_unit"] != stripe_unit:
        raise TierstoreValueError(
            f"{where} describes a store striped over {body['ndirs']} directories with stripe_unit="
            f"{body['stripe_unit']}; open it with the same directories in the same order and that stripe_unit")
    files = body.get("extent_files")
    if not isinstance(files, list) or files != [EXTENT_FILE.format(k) for k in range(len(files))]:
        raise _corrupt(where, "extent_files", "not the list extents-0000.bin, extents-0001.bin ...")
    tensors = body.get("tensors")
    if not isinstance(tensors, dict):
        raise _corrupt(where, "tensors", "not a map of names to tensors")
    parsed = []
    for name in list(tensors):  # each entry's JSON is dropped once it is checked: the parse never holds both
        d = tensors.pop(name)
        if not name or type(d) is not dict:
            raise _corrupt(where, _field(name), "not a named tensor")
        shape, dname = d.get("shape"), d.get("dtype")
        itemsize = _ITEMSIZE.get(dname) if type(dname) is str else None
        nbytes = itemsize or 0  # bytes
        if type(shape) is not list or len(shape) > 64:
            raise _corrupt(where, f"{_field(name)}.shape", f"{str(shape)[:80]} is not a shape")
        for n in shape:
            if type(n) is not int or not 0 <= n < 1 << 62:
                raise _corrupt(where, f"{_field(name)}.shape", f"{str(shape)[:80]} is not a shape")
            nbytes *= n
        if itemsize is None:
            raise _corrupt(where, f"{_field(name)}.dtype", f"{str(dname)[:40]!r} is not a dtype the store holds")
        got = d.get("nbytes")
        if type(got) is not int or got != nbytes:
            raise _corrupt(where, f"{_field(name)}.nbytes", f"{got!r} is not {shape} x {itemsize} bytes")
        config = d.get("codec")
        codec = IDENTITY if config is None else manifest_codec(config, where, f"{_field(name)}.codec")
        ext = Extent.from_json(d.get("extent"), where, lambda: f"{_field(name)}.extent")  # noqa: B023 (raised here)
        if codec is IDENTITY and ext.length != nbytes:
            raise _corrupt(where, f"{_field(name)}.extent.length", f"{ext.length} bytes hold {nbytes} raw bytes")
        parsed.append(Entry(name, shape, STORED_DTYPES[str(dname)], codec, ext, nbytes))
    return body["generation"], parsed


def manifest_codec(config, where: str, field: str):
    """The codec a manifest entry names; codecs that decode to Python objects (numcodecs' pickle codec
    unpickles) are refused."""
    if config is None:
        return IDENTITY
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise _corrupt(where, field, f"{str(config)[:80]} is not a codec configuration")
    if config["id"] in OBJECT_CODECS:
        raise _corrupt(where, field, f"codec {config['id']!r} decodes to Python objects (or unpickles); a "
                       "store never uses it")
    try:
        return codec_from_config(config)
    except (ValueError, TypeError, KeyError) as e:
        if "not available" in str(e) or "codec not" in str(e):
            raise TierstoreValueError(f"{where}: {field} names codec {config['id']!r}, which is not "
                                      f"registered: import the package that provides it first") from None
        raise _corrupt(where, field, f"{type(e).__name__}: {e}") from None


def tensor_entry(shape, dtype: torch.dtype, nbytes: int, codec, extent: Extent) -> dict:
    """The manifest's record of one tensor whose bytes are `extent`."""
    return {"shape": list(shape), "dtype": dtype_name(dtype), "nbytes": nbytes, "codec": codec_config(codec),
            "extent": extent.to_json()}


def write_manifest(directory: str, tensors: dict[str, dict], *, generation: int, ndirs: int, stripe_unit: int,
                   nfiles: int, limit: int | None = None) -> None:
    """Write the manifest naming `tensors` (name -> tensor_entry) to a temporary file in `directory`, fsync it
    and rename it over the last one (the directory fsync that makes the rename durable is the caller's).
    Raises with nothing renamed; a manifest over `limit` bytes (manifest_limit) is refused before it is
    written, so a flush never leaves one a reopen would refuse."""
    body = {
        "version": VERSION,  # under the checksum (manifests before it have the version outside only)
        "generation": generation, "ndirs": ndirs, "stripe_unit": stripe_unit,
        "extent_files": [EXTENT_FILE.format(k) for k in range(nfiles)],
        "tensors": tensors,
    }
    # Serialised once, by json's C encoder (json.dump to a file takes the pure-Python path): the body in
    # the canonical form its crc32c covers, wrapped as the document (see read_manifest).
    body_text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    text = (f'{{"format":{json.dumps(FORMAT)},"version":{VERSION},'
            f'"crc32c":{crc32c.crc32c(body_text.encode())},"body":{body_text}}}')
    final = os.path.join(directory, MANIFEST)
    tmp = final + ".tmp"
    data = text.encode()
    if limit is not None and len(data) > limit:
        raise TierstoreValueError(
            f"flush: the manifest would be {len(data)} bytes, more than a reopen accepts for these extent files "
            f"({limit} bytes: see 'How large a manifest can be' in docs/store.md); nothing was written. Store "
            "fewer empty tensors or shorter names, or group small tensors into larger ones")
    kept = ("nothing was renamed, the previous flush stands and every unflushed value is still held: once that "
            "is fixed, call flush() again")
    with profile_range("tierstore::manifest"):
        try:  # what stands at the .tmp name is not tierstore's when this refuses it: it is left alone
            fd = own_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what="flush: creating the manifest")
        except TierstoreIOError as e:
            raise TierstoreIOError(e.errno, f"{e.strerror}; {kept}", e.filename) from None
        try:
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise io_error(e.errno or errno.EIO, "flush: writing the manifest", tmp, None, None, kept) from None
