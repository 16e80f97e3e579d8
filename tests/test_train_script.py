"""scripts/train.sh: ``--nproc N`` (or ``NPROC=N``) becomes the launcher's rank count, and
never reaches the training script, which refuses it under a launcher.

The script runs in a scratch copy of the project whose set-up does nothing and whose
``.venv/bin/python`` only logs its arguments, so these tests take milliseconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[1]


def train_sh(tmp_path: Path, *args: str, nproc_env: str | None = None
             ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run train.sh with ``args``; the result and the arguments python was called with."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True, exist_ok=True)
    (project / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "train.sh", project / "scripts" / "train.sh")
    (project / "examples" / "train_chars").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "examples" / "train_chars" / "cli.py",
                project / "examples" / "train_chars" / "cli.py")
    (project / "scripts" / "setup.sh").write_text(
        '#!/usr/bin/env bash\ntouch "$(dirname "$0")/set-up-ran"\n')
    python = project / ".venv" / "bin" / "python"
    python.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$(dirname "$0")/argv"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    if nproc_env is not None:
        env["NPROC"] = nproc_env
    argv = project / ".venv" / "bin" / "argv"
    argv.unlink(missing_ok=True)  # an earlier call's
    res = subprocess.run(["bash", str(project / "scripts" / "train.sh"), *args], env=env,
                         capture_output=True, text=True, timeout=30)
    return res, argv.read_text().splitlines() if argv.exists() else []


LAUNCH = ["-m", "tandem.run", "--standalone", "--nproc-per-node"]


def test_nproc_sets_the_launchers_ranks_and_the_other_flags_go_to_the_script(
        tmp_path: Path) -> None:
    res, argv = train_sh(tmp_path, "--quick", "--nproc", "4", "--steps", "5")
    assert res.returncode == 0, res.stderr
    assert argv == [*LAUNCH, "4", "examples/train_chars.py", "--quick", "--steps", "5"]
    _, argv = train_sh(tmp_path, "--nproc=3")
    assert argv == [*LAUNCH, "3", "examples/train_chars.py"]


def test_nproc_comes_from_the_environment_and_defaults_to_two(tmp_path: Path) -> None:
    _, argv = train_sh(tmp_path, nproc_env="3")
    assert argv[:5] == [*LAUNCH, "3"]
    _, argv = train_sh(tmp_path)
    assert argv[:5] == [*LAUNCH, "2"]


def test_a_bad_nproc_is_refused_before_anything_runs(tmp_path: Path) -> None:
    for bad in (["--nproc", "0"], ["--nproc", "four"], ["--nproc"]):
        res, argv = train_sh(tmp_path, *bad)
        assert res.returncode == 2 and "train.sh: --nproc" in res.stderr, (bad, res.stderr)
        assert argv == []


def test_a_mistyped_flag_is_refused_before_set_up_with_the_flag_it_resembles(
        tmp_path: Path) -> None:
    for typo, meant in (("--quik", "--quick"), ("--step", "--steps")):  # a prefix is no flag
        res, argv = train_sh(tmp_path, typo, "3")
        assert res.returncode == 2, res.stderr
        assert f"unrecognized arguments: {typo} 3 (did you mean {meant}?)" in res.stderr
        assert argv == [] and not (tmp_path / "project" / "scripts" / "set-up-ran").exists()
    res, argv = train_sh(tmp_path, "--steps", "0")
    assert res.returncode == 2 and "--steps must be positive" in res.stderr
    assert argv == []


def test_help_is_answered_without_set_up_or_workers(tmp_path: Path) -> None:
    res, argv = train_sh(tmp_path, "--quick", "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: train_chars.py" in res.stdout and "processes:" in res.stdout
    assert argv == [] and not (tmp_path / "project" / "scripts" / "set-up-ran").exists()
