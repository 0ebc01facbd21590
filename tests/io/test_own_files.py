"""tierstore's own files are opened without following a final symlink, and only regular files are read
([Note: tierstore's own files] in tierstore/io/files.py)."""
from __future__ import annotations

import os

import pytest

from tierstore.errors import TierstoreIOError
from tierstore.io.files import own_open, read_small


def test_symlink_is_refused_and_target_untouched(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_bytes(b"keep me!!")
    os.symlink(target, tmp_path / "own.bin")
    with pytest.raises(TierstoreIOError, match="symlink") as e:
        own_open(tmp_path / "own.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    assert e.value.filename == str(tmp_path / "own.bin")
    assert target.read_bytes() == b"keep me!!"


def test_dangling_symlink_is_not_created_through(tmp_path):
    os.symlink(tmp_path / "made-by-link", tmp_path / "own.bin")
    with pytest.raises(TierstoreIOError, match="symlink"):
        own_open(tmp_path / "own.bin", os.O_WRONLY | os.O_CREAT)
    assert not (tmp_path / "made-by-link").exists()


def test_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(TierstoreIOError, match="not a regular file"):
        read_small(tmp_path / "fifo", 1 << 10)


def test_size_cap(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_small(tmp_path / "f", 100) == b"x" * 100
    with pytest.raises(TierstoreIOError, match="more than such a file can need"):
        read_small(tmp_path / "f", 99)


def test_fifo_opened_for_writing_is_named_as_such(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(TierstoreIOError, match="not a regular file"):
        own_open(tmp_path / "fifo", os.O_WRONLY)


@pytest.mark.parametrize("swap", ["symlink", "another file"])
def test_the_direct_descriptor_is_the_same_file(tmp_path, monkeypatch, swap):
    """File opens its O_DIRECT descriptor by name a second time: a name changed in between (a symlink put
    there, another file renamed over it) is refused, and the link's target is not opened for writing."""
    from tierstore.io import files

    path, outside = tmp_path / "extents-0000.bin", tmp_path / "outside.txt"
    outside.write_bytes(b"keep me!!")
    (tmp_path / "other").write_bytes(b"")
    real_open, calls = os.open, []

    def racing_open(p, flags, *a):
        fd = real_open(p, flags, *a)
        calls.append(p)
        if len(calls) == 1:  # between the two opens of the same name
            os.unlink(path)
            if swap == "symlink":
                os.symlink(outside, path)
            else:
                os.replace(tmp_path / "other", path)
        return fd

    monkeypatch.setattr(files.os, "open", racing_open)
    try:
        f = files.File(path, "c", direct=True, own=True)
    except TierstoreIOError as e:
        assert e.filename == str(path)
        assert ("never follows one there" in str(e)) if swap == "symlink" else ("another file" in str(e))
    else:
        no_direct = f.direct_fd is None
        f.close()
        assert no_direct, "the O_DIRECT descriptor was opened on what the name led to after the change"
    assert outside.read_bytes() == b"keep me!!"
