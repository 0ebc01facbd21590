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
