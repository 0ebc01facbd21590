"""Files as the engine sees them: a plain file (O_DIRECT where the filesystem allows it, plus a buffered
descriptor for what is not aligned) and a striped file (RAID-0 over several directories).

A file maps a logical byte range to physical pieces ``(File, physical_offset, offset_in_range, length)``;
the engine turns pieces into requests.
"""
from __future__ import annotations

import errno
import logging
import os
import stat as _stat
import threading
from collections.abc import Sequence

from ..errors import TierstoreIOError, TierstoreValueError, io_error

log = logging.getLogger("tierstore.io")

ALIGN = 4096  # bytes
_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "c": os.O_RDWR | os.O_CREAT,  # create if missing, keep what is there
}
_no_direct_warned: set[int] = set()  # st_dev of filesystems already reported as refusing O_DIRECT
_warn_lock = threading.Lock()


def _flags(mode: str) -> int:
    try:
        return _MODES[mode] | getattr(os, "O_CLOEXEC", 0)
    except KeyError:
        raise TierstoreValueError(f"mode={mode!r} is not one of {sorted(_MODES)}") from None


def _not_regular(what: str, path: str) -> TierstoreIOError:
    return io_error(errno.EINVAL, what, path, None, None,
                    "not a regular file (a FIFO, device or directory stands where tierstore keeps its own file): "
                    "remove it")


def own_open(path: str | os.PathLike, flags: int, perm: int = 0o644, *, what: str = "open") -> int:
    """``os.open`` for a file tierstore owns: never follows a final symlink, and refuses anything that is not
    a regular file (a FIFO, a device, a directory) with an error naming the path.

    [Note: tierstore's own files]
    Everything tierstore creates or writes sits at a name it chose inside a directory the user gave it. A
    symlink planted at such a name (a downloaded checkpoint directory, a shared scratch directory) must not
    send tensor data, a lock or a checkpoint name to the link's target, and a FIFO or device there must not
    block or feed an endless read: the final component is opened with O_NOFOLLOW (and O_NONBLOCK, dropped
    once fstat says it is a regular file), and anything but a regular file is refused."""
    p = os.fspath(path)
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), perm)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise io_error(e.errno, what, p, None, None,
                           "a symlink stands where tierstore keeps its own file; tierstore never follows "
                           "one there: remove the link") from None
        try:  # a FIFO opened for writing with no reader answers ENXIO: say what stands there instead
            st = os.lstat(p)
        except OSError:
            st = None
        if st is not None and not _stat.S_ISREG(st.st_mode) and not _stat.S_ISDIR(st.st_mode):
            raise _not_regular(what, p) from None
        raise io_error(e.errno or errno.EIO, what, p, None, None) from None
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise _not_regular(what, p)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike, limit: int, *, what: str = "read") -> bytes:
    """The whole of a small regular file tierstore owns (a manifest, a checkpoint's meta.json or `latest`),
    opened as [Note: tierstore's own files] says; a file over `limit` bytes is refused before it is read."""
    p = os.fspath(path)
    fd = own_open(p, os.O_RDONLY, what=what)
    try:
        size = os.fstat(fd).st_size  # bytes
        if size > limit:
            raise TierstoreIOError(errno.EFBIG, f"{what} refused: {size} bytes is more than such a file can need "
                                   f"({limit}); it is not one of tierstore's files, or it is damaged", p, 0, size)
        chunks = []
        got = 0
        while got <= limit:
            b = os.read(fd, min(limit + 1 - got, 1 << 20))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise TierstoreIOError(errno.EFBIG, f"{what} refused: the file grew past {limit} bytes while it was "
                                   "read", p, 0, got)
        return b"".join(chunks)
    except OSError as e:
        if isinstance(e, TierstoreIOError):
            raise
        raise io_error(e.errno or errno.EIO, what, p, None, None) from None
    finally:
        os.close(fd)


def remove_own(path: str | os.PathLike, *, what: str = "remove a leftover") -> None:
    """Remove a file tierstore left at `path` (a crash's temporary file); nothing when there is none. Anything
    but a regular file there was not left by tierstore: it is refused, not removed ([Note: tierstore's own
    files])."""
    p = os.fspath(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise io_error(e.errno or errno.EIO, what, p, None, None) from None
    if _stat.S_ISLNK(st.st_mode):
        raise io_error(errno.ELOOP, what, p, None, None,
                       "a symlink stands where tierstore keeps its own file; tierstore never follows one there: "
                       "remove the link")
    if not _stat.S_ISREG(st.st_mode):
        raise io_error(errno.EINVAL, what, p, None, None,
                       "not a regular file (a FIFO, device or directory stands where tierstore keeps its own "
                       "file): remove it")
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise io_error(e.errno or errno.EIO, what, p, None, None) from None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable (a new or renamed file in it survives a crash)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise io_error(e.errno or errno.EIO, "open directory", os.fspath(path), None, None) from None
    try:
        os.fsync(fd)
    except OSError as e:
        raise io_error(e.errno or errno.EIO, "fsync directory", os.fspath(path), None, None) from None
    finally:
        os.close(fd)


class File:
    """One open file. `direct_fd` is None where O_DIRECT is refused (tmpfs, some network filesystems).

    own: the file is one tierstore named inside a directory it was given (an extent file): both descriptors
    are opened as [Note: tierstore's own files] says (no final symlink followed, regular files only)."""

    def __init__(self, path: str | os.PathLike, mode: str = "c", *, direct: bool = True, own: bool = False):
        self.path = os.fspath(path)
        self.mode = mode
        flags = _flags(mode)
        try:
            self.fd = own_open(self.path, flags) if own else os.open(self.path, flags, 0o644)
        except OSError as e:
            if isinstance(e, TierstoreIOError) and e.errno != errno.ENOENT:
                raise
            hint = ""
            if e.errno == errno.ENOENT:
                parent = os.path.dirname(os.path.abspath(self.path))
                hint = (f"the directory {parent!r} does not exist; create it first"
                        if not os.path.isdir(parent) else "the file does not exist; open it with mode 'c' or 'w'")
            raise io_error(e.errno or errno.EIO, "open", self.path, None, None, hint) from None
        self.direct_fd: int | None = None
        if direct:
            try:
                self.direct_fd = self._open_direct(flags, own)
            except BaseException:
                os.close(self.fd)
                raise
        self.slots: dict[int, int] = {}  # fd -> registered-file slot (set by the io_uring backend)
        self.closed = False

    def _open_direct(self, flags: int, own: bool) -> int | None:
        """The O_DIRECT descriptor of the file `self.fd` has open, None where the filesystem refuses O_DIRECT.

        A second open by name, so it must find the same file: an own file's name is not followed if a
        symlink was put there in between, and any name that now leads to another file is refused."""
        dflags = (flags & ~(os.O_CREAT | os.O_TRUNC)) | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        try:
            dfd = os.open(self.path, dflags | (os.O_NOFOLLOW | os.O_NONBLOCK if own else 0))
        except OSError as e:
            if e.errno != errno.EINVAL:
                hint = ("a symlink now stands where tierstore keeps its own file; tierstore never follows one "
                        "there: remove the link") if e.errno == errno.ELOOP and own else ""
                raise io_error(e.errno or errno.EIO, "open (O_DIRECT)", self.path, None, None, hint) from None
            dev = os.fstat(self.fd).st_dev
            with _warn_lock:
                if dev not in _no_direct_warned:
                    _no_direct_warned.add(dev)
                    log.info("%s: the filesystem refuses O_DIRECT; using buffered I/O there", self.path)
            return None
        a, b = os.fstat(self.fd), os.fstat(dfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(dfd)
            raise io_error(errno.ESTALE, "open (O_DIRECT)", self.path, None, None,
                           "the name now leads to another file than the one opened a moment before (it was "
                           "replaced meanwhile): nothing else may write into the directory")
        if own:
            os.set_blocking(dfd, True)
        return dfd

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    def files(self) -> list[File]:
        return [self]

    def map(self, offset: int, length: int) -> list[tuple[File, int, int, int]]:
        return [(self, offset, 0, length)] if length else []

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def truncate(self, nbytes: int) -> None:
        os.ftruncate(self.fd, nbytes)

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)  # per inode: covers writes through either descriptor
        except OSError as e:
            raise io_error(e.errno or errno.EIO, "fsync", self.path, None, None) from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.direct_fd, self.fd):
                if fd is not None:
                    os.close(fd)

    def __repr__(self) -> str:
        return f"File({self.path!r}, direct={self.direct})"


class StripedFile:
    """One logical file striped RAID-0 over one file per directory, `stripe_unit` bytes at a time.

    Logical stripe k lives in directory k % n at physical offset (k // n) * stripe_unit. `name` is one
    tierstore chose, so each part is opened as its own file ([Note: tierstore's own files]).
    """

    def __init__(self, dirs: Sequence[str | os.PathLike], name: str, mode: str = "c", *,
                 stripe_unit: int = 1 << 20, direct: bool = True):
        if not dirs:
            raise TierstoreValueError("a striped file needs at least one directory")
        if stripe_unit <= 0 or stripe_unit % ALIGN:
            raise TierstoreValueError(f"stripe_unit={stripe_unit} must be a positive multiple of {ALIGN} bytes")
        self.stripe_unit = stripe_unit  # bytes
        self.name = name
        self.path = ",".join(os.path.join(os.fspath(d), name) for d in dirs)
        self.parts: list[File] = []
        try:
            for d in dirs:
                self.parts.append(File(os.path.join(os.fspath(d), name), mode, direct=direct, own=True))
        except BaseException:
            self.close()
            raise

    @property
    def direct(self) -> bool:
        return all(p.direct for p in self.parts)

    def files(self) -> list[File]:
        return list(self.parts)

    def map(self, offset: int, length: int) -> list[tuple[File, int, int, int]]:
        n, unit = len(self.parts), self.stripe_unit
        out: list[tuple[File, int, int, int]] = []
        pos, end = offset, offset + length
        while pos < end:
            k, within = divmod(pos, unit)
            take = min(unit - within, end - pos)
            phys = (k // n) * unit + within
            part = self.parts[k % n]
            # Merge with the previous piece when it continues in the same part (n == 1).
            if out and out[-1][0] is part and out[-1][1] + out[-1][3] == phys:
                f, o, b, nbytes = out[-1]
                out[-1] = (f, o, b, nbytes + take)
            else:
                out.append((part, phys, pos - offset, take))
            pos += take
        return out

    def size(self) -> int:
        """Logical size: the end of the last byte held in any part."""
        n, unit = len(self.parts), self.stripe_unit
        best = 0
        for i, p in enumerate(self.parts):
            s = p.size()
            if s == 0:
                continue
            k_local, within = divmod(s - 1, unit)
            best = max(best, (k_local * n + i) * unit + within + 1)
        return best

    def truncate(self, nbytes: int) -> None:
        n, unit = len(self.parts), self.stripe_unit
        full, rest = divmod(nbytes, unit)  # full stripes, bytes in the last partial stripe
        for i, p in enumerate(self.parts):
            stripes = full // n + (1 if i < full % n else 0)
            extra = rest if i == full % n else 0
            p.truncate(stripes * unit + extra)

    def fsync(self) -> None:
        for p in self.parts:
            p.fsync()

    def close(self) -> None:
        for p in self.parts:
            p.close()

    @property
    def closed(self) -> bool:
        return all(p.closed for p in self.parts)

    def __repr__(self) -> str:
        return f"StripedFile({self.name!r} over {len(self.parts)} dirs, unit={self.stripe_unit})"
