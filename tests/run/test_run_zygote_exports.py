"""The zygotes (tandemrun's, the scale benchmark's) bind tandem's lazily exported names
before they fork: otherwise every worker resolved ``tandem.init_process_group`` and
``tandem.barrier`` itself on first use (``tandem.__getattr__``, an import lookup), ~50
copy-on-write page faults a rank at start-up, in pages shared with the zygote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

# a fresh interpreter: this test process may have resolved the names already
SCRIPT = """
import json, sys
import tandem, tandem.collectives.api, tandem.collectives.barriers
from tandem.run import _zygote
before = set(sys.modules)
bound = lambda: sorted(n for n in ("init_process_group", "barrier", "all_reduce", "rpc_sync")
                       if n in vars(tandem))
first = bound()
_zygote.WARM_MODULES = ("tandem", "tandem.collectives.api", "tandem.collectives.barriers")
why = _zygote.warm_up()
print(json.dumps({"first": first, "after": bound(), "why": why,
                  "imported": sorted(set(sys.modules) - before)}))
"""


def test_warm_up_binds_the_exports_of_imported_modules_and_imports_nothing() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # forkable
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["why"] == ""
    assert got["first"] == [], "names bound before the warm-up: the test sees nothing"
    assert got["after"] == ["all_reduce", "barrier", "init_process_group"], got
    assert got["imported"] == [], "binding the names imported modules"
