"""tandem under a real SLURM (munged, slurmctld, 2 slurmd, each node its own host).

The fixture (``tandem.testing.slurm``) skips, naming what is missing, without root or
the packages (``scripts/cluster_packages.sh`` installs them; CI runs it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tandem.testing.slurm import SlurmCluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_chars.py"
PROBE = Path(__file__).with_name("_probe.py")
PY = sys.executable
TANDEMRUN = str(Path(sys.executable).with_name("tandemrun"))
# the main example, as small as it goes: the test is the launch, not the training
TINY = ["--quick", "--steps", "4", "--corpus-mb", "0.1"]
SECRET = {"TANDEM_SECRET": "slurm-test-secret"}
JOB_S = 150.0


def _ranks(out: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: int(str(r["rank"])))


def _no_leftovers(slurm: SlurmCluster) -> None:
    left = slurm.wait_no_leftovers(30)
    assert not left, f"processes left on the nodes: {left}"


@pytest.mark.timeout(200)
def test_srun_one_task_per_rank_derives_everything(slurm: SlurmCluster) -> None:
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=2", PY, str(PROBE)], timeout=JOB_S,
                     env=SECRET)
    ranks = _ranks(done.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], done.stdout + done.stderr
    assert {r["sum"] for r in ranks} == {10.0} and {r["world"] for r in ranks} == {4}
    assert [r["host"] for r in ranks] == ["node1", "node1", "node2", "node2"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert [r["GROUP_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    # "node1" resolves nowhere: its NodeAddr came from scontrol
    assert {r["MASTER_ADDR"] for r in ranks} == {slurm.node_addrs[0]}
    _no_leftovers(slurm)


@pytest.mark.timeout(200)
def test_srun_one_task_per_rank_trains_the_main_example(slurm: SlurmCluster,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=2", PY, str(EXAMPLE), *TINY,
                      "--out", str(out)], timeout=JOB_S, env=SECRET)
    assert "train_chars: 4 ranks" in done.stdout, done.stdout + done.stderr
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 4
    _no_leftovers(slurm)


@pytest.mark.timeout(200)
def test_srun_one_tandemrun_per_node_trains_the_main_example(slurm: SlurmCluster,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=1", TANDEMRUN, "--nproc-per-node", "2",
                      str(EXAMPLE), *TINY, "--out", str(out)], timeout=JOB_S, env=SECRET)
    assert "train_chars: 4 ranks" in done.stdout, done.stdout + done.stderr
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 4
    _no_leftovers(slurm)


def test_a_multi_node_step_without_a_secret_is_refused(slurm: SlurmCluster) -> None:
    env = {"TANDEM_SECRET": "", "XDG_CONFIG_HOME": str(slurm.workdir / "home")}
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=1", PY, "-c",
                      "from tandem.config import load_secret; load_secret()"],
                     timeout=60, check=False, env=env)
    assert done.returncode != 0
    assert "python -m tandem.secret" in done.stderr, done.stderr
