"""Where io_uring is forbidden (seccomp in containers), `auto` falls back to threads and says why, and
`io_uring` is refused with a clear error. The child process installs a real seccomp filter."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import ctypes, logging, sys
    libc = ctypes.CDLL(None, use_errno=True)

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    NR_IO_URING_SETUP = 425            # the same number on every architecture (unified syscall table)
    prog_insns = (Filter * 4)(
        Filter(0x20, 0, 0, 0),                    # A = seccomp_data.nr
        Filter(0x15, 0, 1, NR_IO_URING_SETUP),    # if A == io_uring_setup
        Filter(0x06, 0, 0, 0x00050000 | 1),       #   return ERRNO(EPERM)
        Filter(0x06, 0, 0, 0x7FFF0000),           # return ALLOW
    )
    prog = Prog(4, prog_insns)
    assert libc.prctl(38, 1, 0, 0, 0) == 0                        # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER

    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)
    import numpy as np
    from tierstore.errors import BackendUnavailableError
    from tierstore.io import Engine, io_uring_status
    print("STATUS", io_uring_status())
    with Engine(backend="auto") as e:
        print("BACKEND", e.backend)
        data = np.arange(1 << 18, dtype=np.int32)
        e.write(sys.argv[1], data, 0).result()
        back = np.empty_like(data)
        e.read(sys.argv[1], back, 0).result()
        print("EXACT", bool((back == data).all()))
    try:
        Engine(backend="io_uring")
    except BackendUnavailableError as err:
        print("REFUSED", err)
""")


@pytest.mark.skipif(platform.system() != "Linux", reason="seccomp is Linux-only")
def test_seccomp_forbidding_io_uring_falls_back(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "f.bin")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "STATUS (False, 'io_uring is forbidden here (EPERM: seccomp" in out
    assert "LOG tierstore: io_uring is forbidden here" in out and "falling back to the thread-pool backend" in out
    assert "BACKEND threads" in out and "EXACT True" in out
    assert "REFUSED backend='io_uring' requested but io_uring is forbidden" in out
