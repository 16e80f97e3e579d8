"""``dir(tandem)`` shows tandem's own names, not the helpers its ``__init__`` imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs


def test_dir_of_a_fresh_import_is_the_public_surface() -> None:
    # a fresh interpreter: other tests import submodules, which Python adds as attributes
    code = "import tandem; print(' '.join(n for n in dir(tandem) if n not in tandem.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["__version__"], f"dir(tandem) shows non-public names: {out}"
