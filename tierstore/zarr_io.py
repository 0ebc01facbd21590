"""Zarr v3 export and import of a store's tensors (one array per tensor, readable by plain zarr).

Works on (name, tensor) pairs only: Store.export_zarr / Store.import_zarr feed it and take its results, so
this module knows nothing of the store. Dtypes numpy lacks (bfloat16, float8) are stored as same-width
unsigned integers; the array attribute 'torch_dtype' names the real one.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator

import torch

from .encoding import dtype_from_name, dtype_name, to_numpy
from .errors import TierstoreValueError

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


def write_group(path: str | os.PathLike, names: Iterable[str], read: Callable[[str], torch.Tensor], *,
                version: int, compressor=None, chunk_bytes: int = 64 << 20) -> None:
    """Write the tensor `read(name)` (a CPU tensor) of every name to a new zarr v3 group at `path`."""
    import zarr

    target = export_target(path)
    compressors = _zarr_compressors(compressor)
    root = zarr.open_group(target, mode="w", zarr_format=3)
    root.attrs["tierstore"] = {"version": version}
    used: set[str] = set()
    for i, name in enumerate(sorted(names)):
        value = read(name).contiguous()
        arr = to_numpy(value)
        key = name if _zarr_name_ok(name) and name not in used else f"tensor_{i}"
        used.add(key)
        a = root.create_array(key, shape=arr.shape, dtype=arr.dtype, chunks=_chunks(arr.shape, arr.itemsize,
                              chunk_bytes), compressors=compressors, fill_value=0,
                              attributes={"tierstore_name": name, "torch_dtype": dtype_name(value.dtype)})
        if arr.size:
            a[...] = arr


def export_target(path) -> str:
    """`path` of export_zarr as a str, refused (TierstoreValueError naming it and what to pass) unless the group
    can go there without destroying anything but an earlier zarr group: a new path (its parents are made), an
    empty directory, or a zarr group's directory (replaced). An existing file, or a directory holding other
    things (writing the group deletes a directory's contents), is refused."""
    want = "pass the path of a new or empty directory, or of a zarr group to replace"
    try:
        p = os.fspath(path)
    except TypeError:
        raise TierstoreValueError(f"export_zarr(path={path!r}): got a {type(path).__name__}, not a path; "
                                  f"{want} (a str or os.PathLike)") from None
    if not isinstance(p, str) or "\0" in p:
        raise TierstoreValueError(f"export_zarr(path={p!r}): a path is a str without NUL characters; {want}")
    if os.path.lexists(p) and not os.path.isdir(p):
        raise TierstoreValueError(f"export_zarr(path={p!r}): an existing file, not a directory; {want}")
    if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "zarr.json")) and os.listdir(p):
        raise TierstoreValueError(f"export_zarr(path={p!r}): a directory that holds other files and is no zarr "
                                  f"group (writing the group would delete them); {want}")
    parent = os.path.dirname(os.path.abspath(p))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise TierstoreValueError(f"export_zarr(path={p!r}): {parent} is a file, so nothing can be made under it; "
                                  f"{want}")
    return p


def read_group(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every array of the zarr group at `path`, in its real torch dtype. The group is
    opened now (a missing one raises here); the arrays are read as the result is iterated."""
    import zarr

    return _tensors(zarr.open_group(os.fspath(path), mode="r"))


def _tensors(root) -> Iterator[tuple[str, torch.Tensor]]:
    for key, arr in _all_arrays(root):
        data = arr[...]
        name = arr.attrs.get("tierstore_name", key)
        tdt = arr.attrs.get("torch_dtype")
        t = torch.from_numpy(data.copy()) if data.ndim else torch.tensor(data[()])
        if tdt is not None and dtype_from_name(tdt) != t.dtype:
            t = t.view(dtype_from_name(tdt))
        yield name, t


def _zarr_name_ok(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name)) and not any(s in (".", "..") or s.startswith("__")
                                                       for s in name.split("/"))


def _chunks(shape: tuple, itemsize: int, chunk_bytes: int) -> tuple:
    if not shape:
        return ()
    chunks = [max(1, s) for s in shape]
    row = itemsize
    for s in chunks[1:]:
        row *= s
    chunks[0] = max(1, min(chunks[0], chunk_bytes // max(1, row)))
    return tuple(chunks)


def _zarr_compressors(compressor):
    if compressor is None:
        return None
    from zarr.codecs import numcodecs as zn

    names = {"zstd": zn.Zstd, "blosc": zn.Blosc, "gzip": zn.GZip, "lz4": zn.LZ4, "zlib": zn.Zlib, "bz2": zn.BZ2,
             "lzma": zn.LZMA}
    if isinstance(compressor, str):
        if compressor not in names:
            raise TierstoreValueError(f"compressor={compressor!r}; choose one of {sorted(names)} or pass a codec")
        return [names[compressor]()]
    if hasattr(compressor, "get_config") and not hasattr(compressor, "to_dict"):  # a numcodecs (v2) codec
        cfg = dict(compressor.get_config())
        cid = cfg.pop("id")
        if cid not in names:
            raise TierstoreValueError(f"numcodecs codec {cid!r} is not a compressor zarr v3 can wrap here; use "
                                      f"one of {sorted(names)}")
        return [names[cid](**cfg)]
    return [compressor]


def _all_arrays(group, prefix: str = ""):
    for key, member in group.members():
        full = f"{prefix}{key}"
        if hasattr(member, "shape"):
            yield full, member
        else:
            yield from _all_arrays(member, full + "/")
