"""Fixtures of the fault campaigns (loop-mounted filesystems, cleaned up even on failure) and the table of
trials and outcomes per campaign printed at the end of the run (see [Note: short and soak runs] in
_common.py)."""
from __future__ import annotations

import pytest

from tests.support.dist import context
from tests.support.loopfs import mounted

from ._common import SOAK, TALLY


@pytest.fixture(params=["ext4", "xfs"])
def power_fs(tmp_path, request):
    """A mounted filesystem: 64 MiB of ext4, or 320 MiB of xfs (mkfs.xfs refuses less than 300 MB); the
    images are sparse files, so they take on disk only what is written."""
    yield from mounted(tmp_path, request.param, 64 if request.param == "ext4" else 320)


@pytest.fixture
def small_ext4(tmp_path):
    """A few MiB of ext4, mounted: the full-disk campaign fills it."""
    yield from mounted(tmp_path, "ext4", 16)


@pytest.fixture(scope="session")
def forkserver():
    """The tests' fork server (tests/support/dist.py), with torch and tierstore imported once: each child
    starts at once, single-threaded (forking pytest itself could inherit locks held by its threads)."""
    return context()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TALLY:
        return
    tr = terminalreporter
    tr.section(f"fault campaigns ({'soak' if SOAK else 'short'} run): trials and outcomes")
    try:
        import io

        from rich.console import Console
        from rich.table import Table
        table = Table(show_lines=False)
        for col in ("campaign", "trials", "outcomes"):
            table.add_column(col)
        for name in sorted(TALLY):
            c = TALLY[name]
            table.add_row(name, str(sum(v for k, v in c.items() if not k.startswith("("))),
                          ", ".join(f"{k}: {v}" for k, v in sorted(c.items())))
        buf = io.StringIO()
        Console(file=buf, width=140, force_terminal=False).print(table)
        tr.write(buf.getvalue())
    except ImportError:
        for name in sorted(TALLY):
            tr.write_line(f"{name}: " + ", ".join(f"{k}: {v}" for k, v in sorted(TALLY[name].items())))
