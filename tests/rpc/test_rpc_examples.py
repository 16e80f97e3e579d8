"""The RPC examples run as documented and check themselves (each ends by printing OK).

All four start at once so their start-up overlaps: three standalone (each spawns its
workers with torch.multiprocessing.spawn and meets through env:// on a free port), the
parameter server under ``python -m tandem.run`` (one worker per launched process).
"""

from __future__ import annotations

import ast
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
RUNS = {
    "parameter_server": [sys.executable, "-m", "tandem.run", "--standalone",
                         "--nproc-per-node", "3", "examples/rpc/parameter_server.py", "--quick"],
    "reinforcement_learning": [sys.executable, "examples/rpc/reinforcement_learning.py",
                               "--quick"],
    "pipeline": [sys.executable, "examples/rpc/pipeline.py", "--quick"],
    "hybrid": [sys.executable, "examples/rpc/hybrid.py", "--quick"],
}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    env = {**os.environ, "TANDEM_SECRET": secrets.token_hex(16)}
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, cmd in RUNS.items()}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_docstring_says_how_to_run_it(name: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / "rpc" / f"{name}.py").read_text()))
    assert doc and f"python examples/rpc/{name}.py" in doc, f"examples/rpc/{name}.py: no command"
    assert "tandem.run" in doc, f"examples/rpc/{name}.py: no launcher command"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs_and_checks_itself(runs: dict[str, subprocess.Popen[str]],
                                        name: str) -> None:
    proc = runs[name]
    try:
        output, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"examples/rpc/{name}.py did not finish in 400 s:\n{output}")
    assert proc.returncode == 0, f"examples/rpc/{name}.py exited {proc.returncode}:\n{output}"
    assert "OK" in output.split(), f"examples/rpc/{name}.py:\n{output}"
