"""Shared fixtures. Tests need no GPU and no network; the few that loop-mount a filesystem need root and skip
with the reason without it."""
from __future__ import annotations

import pytest
import torch

from tests.support.loopfs import mounted


@pytest.fixture
def tmp_dir(tmp_path):
    """A directory on the disk under test (tmp_path is on the same filesystem as the checkout's /tmp)."""
    return tmp_path


@pytest.fixture
def ext4(tmp_path):
    """A mounted 24 MiB ext4 image (tests/support/loopfs.py): skipped with the reason where loop mounts
    cannot be had (not root, no loop devices)."""
    yield from mounted(tmp_path, "ext4", 24)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module of tiny-tensor tests (more threads only contend on the
    shared CI cores); use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
