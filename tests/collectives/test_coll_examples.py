"""The extension-point examples run as documented: ``python examples/<name>.py``.

Both scripts start at once (each spawns its own 2 ranks) so their start-up overlaps.
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

pytestmark = [pytest.mark.procs, pytest.mark.timeout(330)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["custom_backend", "custom_algorithm"]
# each example's ranks have 120 s; its interpreter's start and exit took 30 s more at load 50
FINISH_S = 300


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen]]:
    env = {**os.environ, "TANDEM_SECRET": secrets.token_hex(16)}
    procs = {name: subprocess.Popen([sys.executable, f"examples/{name}.py"], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name in EXAMPLES}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_docstring_says_how_to_run_it(name: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / f"{name}.py").read_text()))
    assert doc and f"python examples/{name}.py" in doc, f"examples/{name}.py: no run command"


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_checks_itself(runs, name: str) -> None:
    try:
        output, _ = runs[name].communicate(timeout=FINISH_S)
    except subprocess.TimeoutExpired:
        runs[name].kill()
        output, _ = runs[name].communicate()
        pytest.fail(f"examples/{name}.py did not finish in {FINISH_S} s:\n{output}")
    assert runs[name].returncode == 0, f"examples/{name}.py exited {runs[name].returncode}:\n{output}"
    assert output.rstrip().endswith("OK"), f"examples/{name}.py:\n{output}"
