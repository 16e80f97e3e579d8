"""Which tests the fast tier (``--fast``) runs; see ``tests/conftest.py``."""

from __future__ import annotations

import pytest


def in_fast_tier(item: pytest.Item) -> bool:
    """Tests that start no process, and each package's smoke test."""
    return item.get_closest_marker("smoke") is not None or \
        item.get_closest_marker("procs") is None
