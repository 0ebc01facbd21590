"""Shared fixtures. Tests need no root, no GPU and no network."""
from __future__ import annotations

import pytest


@pytest.fixture
def tmp_dir(tmp_path):
    """A directory on the disk under test (tmp_path is on the same filesystem as the checkout's /tmp)."""
    return tmp_path
