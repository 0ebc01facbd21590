"""The scratch directories ZeRO-3 makes under a user's nvme_path, and the mark that says they are its own.

[Note: scratch directories are marked]
Zero3Optimizer keeps its store in ``<nvme_path>/rank<r>`` (zero.Init in ``init-rank<r>``, activation offload
in ``activations-rank<r>``) and starts it empty on every run: the previous run's states are not this run's.
Starting empty discards whatever store is there, and zero.Init removes its directory when it is done -- so
the name alone must not be enough. When tierstore creates such a directory (or finds it empty) it writes a
small marker file into it naming the owner (``claim``); a later run reuses the directory only when the
marker is there and names the same owner. Anything else at that path is refused with MisuseError naming
it, before anything is written: a symlink (never followed: the store would be written, and later wiped,
wherever it points), a file, or a directory with other contents (a tierstore.Store of the user's, their own
files, a scratch directory of a tierstore version that did not mark them). The marker itself is opened
as [Note: tierstore's own files] in io/files.py says.
"""
from __future__ import annotations

import errno
import json
import os
import stat

from ..errors import MisuseError, TierstoreIOError, io_error
from ..io.files import fsync_dir, own_open, read_small

MARKER = "tierstore-scratch.json"
FORMAT = "tierstore.zero.scratch/1"
_MARKER_LIMIT = 4096  # bytes: the marker is one short JSON object


def _refuse(path: str, owner: str, what: str, remove: str = "") -> MisuseError:
    remove = remove or (f"remove {path} if nothing in it is needed (a scratch directory left without its "
                        f"marker by an older tierstore is safe to remove)")
    return MisuseError(f"{path} {what}; {owner} keeps its scratch store there and reuses only a directory it "
                       f"created itself (marked by its {MARKER}), since it starts that store empty on every "
                       f"run. Pick another nvme_path, or {remove}")


def _read_owner(path: str, owner: str) -> str:
    """The owner named by the marker in `path`; MisuseError when the marker is not one tierstore wrote."""
    marker = os.path.join(path, MARKER)
    try:
        body = json.loads(read_small(marker, _MARKER_LIMIT, what="read scratch marker"))
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("owner"), str):
            raise ValueError
    except (TierstoreIOError, ValueError, UnicodeDecodeError) as e:
        why = str(e) or "not JSON of the expected form"
        raise _refuse(path, owner, f"holds a {MARKER} that is not a marker tierstore wrote ({why})") from None
    return body["owner"]


def _write_marker(path: str, owner: str) -> None:
    """Write the marker naming `owner` into `path` (created or empty); a concurrent writer's marker stands."""
    tmp = os.path.join(path, f".{MARKER}.{os.getpid()}.tmp")
    body = json.dumps({"format": FORMAT, "owner": owner}).encode()
    fd = own_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, what="create scratch marker")
    try:
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, os.path.join(path, MARKER))  # never replaces an existing name (nor follows a link there)
        except FileExistsError:
            pass  # another process claimed it at the same moment: _read_owner checks what it wrote
    except OSError as e:
        if isinstance(e, TierstoreIOError):
            raise
        raise io_error(e.errno or errno.EIO, "write scratch marker", tmp, 0, len(body)) from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    fsync_dir(path)


def claim(path: str | os.PathLike, owner: str) -> str:
    """Make `path` a scratch directory of `owner` (e.g. "Zero3Optimizer") or refuse it; see [Note: scratch
    directories are marked]. Creates the directory (and its parents) when missing. Returns the path."""
    p = os.path.abspath(os.fspath(path))
    for _ in range(2):  # a directory made by a concurrent claim between our lstat and mkdir: look again
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            try:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                os.mkdir(p)
            except FileExistsError:
                continue
            except OSError as e:
                raise io_error(e.errno or errno.EIO, "create scratch directory", p, None, None) from None
            _write_marker(p, owner)
            break
        if stat.S_ISLNK(st.st_mode):
            raise _refuse(p, owner, f"is a symlink (to {os.readlink(p)!r}), which tierstore never follows there",
                          "remove the link (what it points to is left alone)")
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(p, owner, "is not a directory")
        if not os.path.lexists(os.path.join(p, MARKER)):
            others = sorted(n for n in os.listdir(p) if not n.startswith(f".{MARKER}."))
            if others:
                kind = "a tierstore.Store" if "manifest.json" in others else "files"
                shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
                raise _refuse(p, owner, f"holds {kind} that {owner} did not create ({shown})")
            _write_marker(p, owner)
        break
    found = _read_owner(p, owner)
    if found != owner:
        raise _refuse(p, owner, f"is the scratch directory of {found}, not of {owner}")
    return p


def claim_optimizer_dirs(nvme_paths, rank: int, *, activations: bool) -> tuple[list[str], list[str] | None]:
    """Zero3Optimizer's store directories ``<path>/rank<r>`` and, with activation offload on nvme, those of
    its activations ``<path>/activations-rank<r>``, each claimed (or refused) before anything is written."""
    paths = [claim(os.path.join(p, f"rank{rank}"), "Zero3Optimizer") for p in nvme_paths]
    act = [claim(os.path.join(p, f"activations-rank{rank}"), "activation offload") for p in nvme_paths] \
        if activations else None
    return paths, act
