"""A checkpoint directory as save_checkpoint owns it: the names tierstore writes there, which subdirectories
it may remove, and the lock that gives the directory one writer.

    <dir>/latest, latest.tmp           the name of the current checkpoint (save.py)
    <dir>/writer.lock                  flocked by the job that saves here; holds that job's owner record
    <dir>/ckpt-<steps>-<hex>/          one checkpoint; NAME is the pattern of the names tierstore gives them
    <dir>/ckpt-.../tierstore-checkpoint.json
                                       the first file of a new checkpoint directory: the mark that tierstore
                                       made it (its "job" says which run)

[Note: what save_checkpoint removes]
A checkpoint directory is the user's: they keep their own files there (a ``ckpt-best-model/`` copied by
hand, notes, a symlink to another disk). A save removes a subdirectory only when all of these hold: its
name is NAME (``ckpt-<digits>-<hex>``), it is a real directory (lstat: a symlink is never followed nor
removed), and tierstore wrote it -- it holds the mark file, or a meta.json that begins as tierstore's
(older checkpoints, written before the mark), or it is empty (a crash between its mkdir and its mark).
Of those, a directory without meta.json is an interrupted save (the directory has one writer, this job,
so no other save is in progress) and is removed; complete ones are sorted by step and all but the newest
``keep`` besides the new checkpoint are removed. Everything else is left exactly as it is. ``keep`` is
checked before anything is written: an int >= 0, or None to keep every complete checkpoint.

[Note: one writer per checkpoint directory]
Two jobs saving into one directory (a job started twice) delete each other's checkpoints and leave
``latest`` naming the other run's model. So a directory has one writer: the job whose rank 0 holds an
exclusive ``flock`` on ``writer.lock`` (opened as [Note: tierstore's own files] in io/files.py says). Rank
0 takes it at its first save and holds it for the optimizer's life (released by ``close()``, or by the
kernel when the process dies, SIGKILL included), so a second job is refused at its first save even
between the first job's saves -- a lock held only during each save would let two jobs alternate. Only
rank 0 creates, renames and removes anything in the directory, so the ranks of one job are one writer.
The lock file holds the owner record (host, pid, when the process started, a run id); the refused job's
MisuseError names that holder. A holder that died released its flock, so a restarted job takes the
directory over without anyone removing a stale file. At every save the holder checks that the lock file
is still the one it locked (same inode) and still names it; one removed or replaced (by hand, or with the
whole directory) is locked anew as at a first save, so a second job that locked the new file meanwhile
refuses the holder instead of both writing.

flock, not fcntl record locks: a record lock is dropped when the process closes *any* descriptor of the
file, which a reader of the owner record in the same process would do. On NFS the Linux client emulates
flock with whole-file byte-range locks, which the server arbitrates across hosts (NLM, or NFSv4's own
locks, released when the holder's lease expires); a local filesystem is seen by one host, where flock is
exact. A filesystem that refuses flock (ENOLCK, EOPNOTSUPP, ENOSYS: Lustre without ``-o flock``) falls
back to the owner record alone: a record naming another live process on this host (pid alive, same start
time) or any process on another host refuses the save; the error says to remove ``writer.lock`` once
that job is known to be gone. A process forked (not exec'd) after the first save shares the lock; it
is released when the last of them exits. An optimizer holds at most HOLD_MAX directories: one that saves
each checkpoint into a new directory (the Trainer and accelerate integrations) lets go of the least recently
saved beyond that, and of those whose lock file is gone (a directory removed by checkpoint rotation).

[Note: readers and a concurrent cleanup]
Readers (consolidate, load_checkpoint) take no lock: a writer may replace ``latest`` and remove the
checkpoint a reader is reading. read_meta re-reads ``latest`` when the meta.json of the checkpoint it named
is gone and retries with the new name; consolidate retries from the start when a file it needed vanished
and ``latest`` names another checkpoint by then. After RETRIES such races the error says a concurrent
writer removed the checkpoint (ENOENT), never that it is corrupt. Files already opened stay readable
after they are unlinked, so only the opening of each file races.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
import weakref
from typing import Any

from ...errors import CorruptionError, MisuseError, TierstoreIOError, TierstoreValueError, io_error
from ...io.files import own_open, read_small

NAME = re.compile(r"ckpt-[0-9]+-[0-9a-f]+")
LATEST = "latest"
LOCK = "writer.lock"
MARK = "tierstore-checkpoint.json"
MARK_FORMAT = "tierstore.zero.checkpoint.dir"
META_HEAD = b'{\n "format": "tierstore.zero.checkpoint",'  # how every meta.json tierstore writes begins
LATEST_MAX = 256  # bytes: a checkpoint name is ~26
RECORD_MAX = 4096  # bytes of an owner record or a mark
RETRIES = 3  # reads restarted after a concurrent writer moved `latest` on
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # flock refused by the filesystem


def check_keep(keep: Any) -> None:
    """`keep` of save_checkpoint: an int >= 0, or None (keep every complete checkpoint)."""
    if keep is None or (type(keep) is int and keep >= 0):
        return
    raise TierstoreValueError(
        f"save_checkpoint(keep={keep!r}): keep is how many previous checkpoints to leave besides the new one, "
        "an int >= 0 (0: only the new one stays); pass keep=None to keep every checkpoint")


def refuse_link(path: str) -> None:
    """An existing entry at `path`, where tierstore keeps its own file, must be a regular file (not a symlink,
    FIFO, device or directory); TierstoreIOError naming it otherwise. See [Note: tierstore's own files] in
    io/files.py."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise io_error(errno.ELOOP, "save_checkpoint", path, None, None,
                       "a symlink stands where tierstore keeps its own file; tierstore never follows one "
                       "there: remove the link")
    if not stat.S_ISREG(st.st_mode):
        raise io_error(errno.EINVAL, "save_checkpoint", path, None, None,
                       "not a regular file (a FIFO, device or directory stands where tierstore keeps its own "
                       "file): remove it")


# -- the owner record and the lock ----------------------------------------------------------------------------

def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot, /proc/<pid>/stat field 22); None where it
    cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


_RUN = uuid.uuid4().hex[:12]  # this process's run id


def own_record() -> dict:
    """This process's owner record: who holds a checkpoint directory."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": start_time(os.getpid()), "run": _RUN,
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _same_owner(a: dict | None, b: dict) -> bool:
    return a is not None and all(a.get(k) == b[k] for k in ("host", "pid", "start", "run"))


def _read_record(path: str) -> dict | None:
    try:
        rec = json.loads(read_small(path, RECORD_MAX, what="read the owner record"))
    except (OSError, ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def _holder(rec: dict | None) -> str:
    if rec is None:
        return "a job whose owner record cannot be read"
    return (f"pid {rec.get('pid')!r} on host {str(rec.get('host'))[:80]!r} (holding it since "
            f"{str(rec.get('since'))[:40]})")


def _alive(rec: dict) -> bool:
    """Whether the owner a record names may still run: any process on another host (this host cannot tell),
    on this host only a process of that pid and start time."""
    if rec.get("host") != socket.gethostname():
        return True
    pid = rec.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    start = start_time(pid)
    if start is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")  # with /proc, an unreadable stat means the process is gone
    return rec.get("start") in (None, start)


class _Hold:
    """This process's lock on one checkpoint directory, for the optimizer `owner`; dropped (the descriptor
    closed, the flock with it) by release() or when the owner is collected."""

    def __init__(self, directory: str, real: str, fd: int, ino: tuple[int, int], record: dict, flocked: bool,
                 owner):
        self.directory = directory
        self.real = real
        self.fd: int | None = fd
        self.ino = ino
        self.record = record
        self.flocked = flocked
        self.owner = weakref.ref(owner)
        self.finalizer = weakref.finalize(owner, _drop, self)
        self.used = next(_USES)  # when it last saved here

    def pass_to(self, owner) -> None:
        self.finalizer.detach()
        self.owner = weakref.ref(owner)
        self.finalizer = weakref.finalize(owner, _drop, self)


def _drop(hold: _Hold) -> None:
    if hold.fd is not None:
        try:
            os.close(hold.fd)
        except OSError:
            pass
        hold.fd = None
    if _HELD.get(hold.real) is hold:
        del _HELD[hold.real]


_HELD: dict[str, _Hold] = {}  # real path of a checkpoint directory -> this process's hold on it
_USES = itertools.count()
HOLD_MAX = 8  # checkpoint directories one optimizer holds at a time


def _trim(opt) -> None:
    """Before `opt` takes another directory: let go of those of its directories that are gone (a Trainer
    rotating ``checkpoint-<step>`` folders removes them), and of the least recently saved beyond
    HOLD_MAX - 1, so a run that saves each checkpoint into a new directory holds a bounded number of
    descriptors ([Note: one writer per checkpoint directory])."""
    mine = sorted((h for h in _HELD.values() if h.owner() is opt), key=lambda h: h.used)
    for h in mine:
        try:
            st = os.lstat(os.path.join(h.directory, LOCK))
            gone = (st.st_dev, st.st_ino) != h.ino
        except OSError:
            gone = True
        if gone:
            h.finalizer()
    mine = [h for h in mine if h.fd is not None]
    for h in mine[:max(len(mine) - (HOLD_MAX - 1), 0)]:
        h.finalizer()


def _refused(directory: str, path: str, rec: dict | None, extra: str = "") -> MisuseError:
    return MisuseError(f"another job writes checkpoints into {directory}: {_holder(rec)} holds {path}. A "
                       f"checkpoint directory has one writer (see docs/reliability.md); stop that job, or save "
                       f"into another directory{extra}")


def take(opt, directory: str) -> None:
    """Rank 0, at each save: make sure `opt` is the one writer of `directory` ([Note: one writer per
    checkpoint directory]); MisuseError naming the holder when another job or optimizer is."""
    real = os.path.realpath(directory)
    path = os.path.join(directory, LOCK)
    hold = _HELD.get(real)
    if hold is not None and hold.fd is not None:
        other = hold.owner()
        if other is not None and other is not opt and getattr(other, "store", None) is not None:
            raise MisuseError(f"{other!r} in this process writes checkpoints into {directory}; a checkpoint "
                              "directory has one writer: close that optimizer first, or save into another "
                              "directory")
        if other is not opt:  # closed: the lock passes to this optimizer
            hold.pass_to(opt)
        if _still_mine(hold, path):
            hold.used = next(_USES)
            return
        hold.finalizer()  # its lock file was removed or replaced: lock the one there now, as a new writer would
    _trim(opt)
    refuse_link(path)
    fd = own_open(path, os.O_RDWR | os.O_CREAT, what="open the checkpoint directory's lock file")
    try:
        import fcntl
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refused(directory, path, _read_record(path)) from None
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise io_error(e.errno or errno.EIO, "flock", path, None, None) from None
            flocked = False
            rec = _read_record(path)
            if rec is not None and not _same_owner(rec, own_record()) and _alive(rec):
                raise _refused(directory, path, rec, f"; this filesystem has no flock, so only the record tells: "
                                                      f"remove {path} once that job is known to be gone") from None
        mine = own_record()
        data = json.dumps(mine).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    _HELD[real] = _Hold(directory, real, fd, (st.st_dev, st.st_ino), mine, flocked, opt)


def _still_mine(hold: _Hold, path: str) -> bool:
    """Whether the lock file at `path` is still the one `hold` locked (False: removed or replaced); a record
    in it naming another owner (a filesystem without flock) is a MisuseError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != hold.ino:
        return False
    rec = _read_record(path)
    if not _same_owner(rec, hold.record):
        raise _refused(hold.directory, path, rec, " (the owner record was rewritten since this job took it)")
    return True


def held(opt) -> list[str]:
    """The checkpoint directories `opt` holds the lock of, least recently saved first."""
    return [h.directory for h in sorted(_HELD.values(), key=lambda h: h.used) if h.owner() is opt]


def release(opt) -> None:
    """Every lock `opt` holds on a checkpoint directory (its close())."""
    for hold in list(_HELD.values()):
        if hold.owner() is opt:
            hold.finalizer()  # _drop, once


# -- the checkpoint subdirectories ----------------------------------------------------------------------------

def begin(opt, directory: str, name: str) -> tuple[bool, MisuseError | None, tuple[str, Exception] | None]:
    """Rank 0, before a save writes anything: take the directory ([Note: one writer per checkpoint
    directory]), check that `latest` and its temp are tierstore's own files, create the new checkpoint
    directory `name` and mark it. Returns (made: the directory was created, the MisuseError when another
    writer holds the directory, (path, error) when a step failed)."""
    where, made = directory, False
    try:
        os.makedirs(directory, exist_ok=True)
        try:
            take(opt, directory)
        except MisuseError as e:
            return False, e, None
        for own in (LATEST, LATEST + ".tmp"):
            where = os.path.join(directory, own)
            refuse_link(where)
        where = os.path.join(directory, name)
        os.mkdir(where, 0o755)  # fails on anything already there, a symlink included
        made = True
        mark(where)
    except Exception as e:
        return made, None, (getattr(e, "filename", None) or where, e)
    return made, None, None


def mark(sub: str) -> None:
    """The first file of a new checkpoint directory (just made): the mark that tierstore wrote it."""
    fd = own_open(os.path.join(sub, MARK), os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="write")
    try:
        data = json.dumps({"format": MARK_FORMAT, "owner": own_record()}).encode()
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)


def _steps(name: str) -> int:
    return int(name.split("-")[1])


def _kind(path: str) -> str | None:
    """"complete" or "partial" for a checkpoint directory tierstore wrote, "empty" for an empty one, None for
    anything else (never touched). See [Note: what save_checkpoint removes]."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        names = os.listdir(path)
    except OSError:
        return None
    if not names:
        return "empty"
    ours = False
    if "meta.json" in names:
        try:
            fd = own_open(os.path.join(path, "meta.json"), os.O_RDONLY, what="read")
            try:
                ours = os.pread(fd, len(META_HEAD), 0) == META_HEAD
            finally:
                os.close(fd)
        except OSError:
            ours = False
        if ours:
            return "complete"
    if MARK in names:
        rec = _read_record(os.path.join(path, MARK))
        if rec is not None and rec.get("format") == MARK_FORMAT:
            return "complete" if "meta.json" in names else "partial"
    return None


def prune(directory: str, new: str, keep: int | None) -> None:
    """Rank 0, after `new` is committed: remove interrupted saves and the complete checkpoints past `keep`,
    of tierstore's own only ([Note: what save_checkpoint removes])."""
    try:
        names = [n for n in os.listdir(directory) if NAME.fullmatch(n) and n != new]
    except OSError:
        return  # the new checkpoint is complete; older ones go with the next save
    complete = []
    for n in names:
        path = os.path.join(directory, n)
        kind = _kind(path)
        if kind == "empty":
            try:
                os.rmdir(path)  # removes nothing but the name
            except OSError:
                pass
        elif kind == "partial":
            shutil.rmtree(path, ignore_errors=True)
        elif kind == "complete":
            complete.append(n)
    if keep is None:
        return
    complete.sort(key=lambda n: (_steps(n), n))
    for n in complete[:max(len(complete) - keep, 0)]:
        shutil.rmtree(os.path.join(directory, n), ignore_errors=True)


def vanished(directory: str, sub: str, path: str | None) -> bool:
    """Whether the file `path` of checkpoint `sub` is gone because a writer moved `latest` on and removed
    the checkpoint ([Note: readers and a concurrent cleanup])."""
    if path is not None and os.path.lexists(path):
        return False
    try:
        now = read_small(os.path.join(directory, LATEST), LATEST_MAX, what="read").decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return now != os.path.basename(sub)


def removed_error(directory: str, sub: str) -> TierstoreIOError:
    return TierstoreIOError(errno.ENOENT, f"checkpoint {sub} was removed while it was read, {RETRIES} times in a "
                            f"row: a job saving into {directory} prunes old checkpoints (save_checkpoint's keep). "
                            "Read it when no job saves there, or copy the checkpoint out first", sub)


def names(latest: str, name: str) -> bool:
    """Whether the file `latest` holds `name`."""
    try:
        return read_small(latest, LATEST_MAX) == name.encode()
    except OSError:
        return False


def latest_name(directory: str) -> str:
    """The checkpoint `latest` names, checked to be a plain checkpoint name inside `directory` ([Note:
    checkpoints are untrusted input] in records.py); `latest` is read only as a regular file of at most
    LATEST_MAX bytes."""
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise TierstoreValueError(f"{directory} is a file, not a checkpoint directory: pass the directory "
                                      f"given to save_checkpoint (it holds {LATEST!r} and the ckpt-* directories)")
        raise TierstoreValueError(f"no checkpoint directory {directory}: pass the directory given to "
                                  "save_checkpoint")
    path = os.path.join(directory, LATEST)
    try:
        raw = read_small(path, LATEST_MAX, what=f"read {LATEST!r}")
    except TierstoreIOError as e:
        if e.errno != errno.ENOENT:
            raise CorruptionError(f"{LATEST!r} cannot be read ({e.strerror}); write the name of the newest "
                                  "complete ckpt-* directory into it", path) from None
        if os.path.exists(os.path.join(directory, "meta.json")):
            raise TierstoreValueError(f"{directory} is one checkpoint's own directory; pass the directory that "
                                      f"holds it and {LATEST!r}: {os.path.dirname(directory)}") from None
        raise TierstoreValueError(f"no checkpoint in {directory} (no {LATEST!r} file); write one with "
                                  f"opt.save_checkpoint({directory!r})") from None
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not NAME.fullmatch(name):
        shown = raw[:60] if name is None else name[:60]
        raise CorruptionError(f"{LATEST!r} holds {shown!r}, which is not the name of a checkpoint in this "
                              f"directory (ckpt-<steps>-<hex>); write the name of the newest complete ckpt-* "
                              f"directory into it", path)
    return name
