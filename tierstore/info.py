"""`tierstore info`: what this machine offers the library, and what it will fall back to."""
from __future__ import annotations

import errno
import os
import platform
import shutil
import tempfile

from ._report import fmt_bytes, print_table, write_json


def probe_o_direct(directory: str) -> tuple[bool, str]:
    """Can files in `directory` be opened with O_DIRECT? (True/False, why)."""
    if not os.path.isdir(directory):
        return False, f"{directory!r} does not exist"
    try:
        fd, path = tempfile.mkstemp(prefix=".tierstore-probe-", dir=directory)
    except OSError as e:
        return False, f"cannot create a file there: {e.strerror}"
    os.close(fd)
    try:
        dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
        os.close(dfd)
        return True, "O_DIRECT accepted"
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False, "the filesystem refuses O_DIRECT; buffered I/O will be used"
        return False, f"O_DIRECT open failed: {e.strerror}"
    finally:
        os.unlink(path)


def collect(directory: str) -> dict:
    import torch

    from .io import checksum, io_uring_status, memlock_limit

    uring_ok, uring_why = io_uring_status()
    direct_ok, direct_why = probe_o_direct(directory)
    limit = memlock_limit()
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    du = shutil.disk_usage(directory) if os.path.isdir(directory) else None
    try:  # an optional reference for `tierstore bench io`; importing it takes seconds, its metadata does not
        from importlib.metadata import version

        ds = version("deepspeed")
    except Exception:
        ds = None
    return {
        "tierstore": __import__("tierstore").__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "io_uring": {"available": uring_ok, "why": uring_why},
        "default_backend": "io_uring" if uring_ok else "threads",
        "crc32c": checksum.implementation(),
        "directory": os.path.abspath(directory),
        "o_direct": {"available": direct_ok, "why": direct_why},
        "disk_free_bytes": du.free if du else None,
        "memlock_limit_bytes": limit,
        "can_lock_beyond_limit": os.geteuid() == 0,
        "accelerator": str(accel) if accel is not None else None,
        "fio": shutil.which("fio"),
        "deepspeed": ds,
    }


def run_info(args) -> int:
    facts = collect(args.dir)
    lim = facts["memlock_limit_bytes"]
    lock_text = "unlimited" if lim is None else fmt_bytes(lim)
    if lim is not None and facts["can_lock_beyond_limit"]:
        lock_text += " (root: CAP_IPC_LOCK lifts it)"
    elif lim is not None and lim < (1 << 30):
        lock_text += " — pinned pools larger than this fail; raise it with `ulimit -l unlimited`"
    rows = [
        ("tierstore / torch / python", f"{facts['tierstore']} / {facts['torch']} / {facts['python']}"),
        ("kernel, cpus", f"{facts['kernel']}, {facts['cpus']}"),
        ("io_uring", ("yes" if facts["io_uring"]["available"] else "no") + f" — {facts['io_uring']['why']}"),
        ("engine backend (auto)", facts["default_backend"]),
        ("crc32c", "native, VPCLMULQDQ folding" if facts["crc32c"] == "avx512" else facts["crc32c"]),
        ("directory", facts["directory"]),
        ("O_DIRECT there", ("yes" if facts["o_direct"]["available"] else "no") + f" — {facts['o_direct']['why']}"),
        ("free space there", fmt_bytes(facts["disk_free_bytes"]) if facts["disk_free_bytes"] is not None else "-"),
        ("page-lock limit (ulimit -l)", lock_text),
        ("accelerator", facts["accelerator"] or "none (the CPU stands in for the device tier)"),
        ("fio (bench reference)", facts["fio"] or "not on PATH"),
        ("DeepSpeed (bench reference)", facts["deepspeed"] or "not installed"),
    ]
    print_table("tierstore info", ["what", "this machine"], rows)
    write_json(args.json, facts)
    return 0
