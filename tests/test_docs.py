"""The README and the docs site: the site builds with ``mkdocs build --strict`` (a broken
link, anchor or API reference fails), and every code block that claims to run is run.

Each ```python or ```bash block carries a marker comment on the line before it:

- ``<!-- test: run -->``: run as a script in one process;
- ``<!-- test: tandemrun N -->``: run under ``tandemrun --nproc-per-node N``;
- ``<!-- test: covered by tests/x.py -->``: another test runs it (that file must exist);
- ``<!-- test: fragment (why) -->``: not complete as written, and says so.

A block with no marker fails the suite, so no example escapes by being forgotten.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^(?P<marker><!-- test: (?P<how>[^\n]*?) -->)\n)?^```(?P<lang>python|bash|sh)\n"
                   r"(?P<code>.*?)^```$", re.M | re.S)
# what the site needs beyond tandem's own dependencies: the "docs" extra of pyproject.toml
SITE_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    how: str | None
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            found.append(Block(page.relative_to(ROOT).as_posix(), line, m.group("how"), m.group("code")))
    return found


def _marked(how: str) -> list[Block]:
    """The blocks whose marker matches ``how``; a block the README and a page share runs once."""
    found: dict[str, Block] = {}
    for b in blocks():
        if b.how is not None and re.fullmatch(how, b.how):
            found.setdefault(b.code, b)
    return list(found.values())


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TANDEM_SECRET")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_every_code_block_says_whether_and_how_it_runs() -> None:
    unmarked = [str(b) for b in blocks() if b.how is None]
    assert not unmarked, f"code blocks without a '<!-- test: ... -->' marker: {unmarked}"
    known = re.compile(r"run|tandemrun \d+|covered by \S+|fragment \(.+\)")
    unknown = [f"{b}: {b.how}" for b in blocks() if b.how is not None and not known.fullmatch(b.how)]
    assert not unknown, f"markers this test does not know: {unknown}"


def test_blocks_said_to_be_covered_name_a_test_that_exists() -> None:
    for b in _marked(r"covered by \S+"):
        path = ROOT / (b.how or "").removeprefix("covered by ")
        assert path.is_file(), f"{b}: {b.how}, but there is no {path}"


def test_the_readme_carries_its_quick_starts_as_running_blocks() -> None:
    readme = [b for b in blocks() if b.page == "README.md"]
    runs = [b for b in readme if b.how is not None and not b.how.startswith("fragment")]
    assert any("tandem.torch_backend" in b.code for b in runs), "the backend quick start does not run"
    assert any("rpc.init_rpc" in b.code for b in runs), "the RPC quick start does not run"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", _marked("run"), ids=str)
@pytest.mark.procs
def test_a_run_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, f"{block} failed:\n{res.stdout}\n{res.stderr}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _marked(r"tandemrun \d+"), ids=str)
@pytest.mark.procs
def test_a_tandemrun_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    nproc = (block.how or "").split()[1]
    res = subprocess.run([sys.executable, "-m", "tandem.run", "--nproc-per-node", nproc, str(script)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=270)
    assert res.returncode == 0, f"{block} failed under tandemrun:\n{res.stdout}\n{res.stderr}"


@pytest.mark.timeout(600)
@pytest.mark.procs
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    missing = [m for m in SITE_MODULES if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        pytest.skip(f"the docs site's tools are not installed ({', '.join(missing)}): "
                    "pip install -e '.[docs]', or run scripts/setup.sh")
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stdout}\n{res.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "DistributedDataParallel" in api and "all_reduce" in api, "the API reference is empty"
    print(f"mkdocs build --strict: {time.monotonic() - start:.1f} s")
