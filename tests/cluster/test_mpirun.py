"""tandem under Open MPI's real ``mpirun`` across two simulated hosts, a and b.

``mpirun`` runs on host a and reaches host b through an rsh agent that enters b's
namespace (``tandem.testing.mpi``); skips, naming what is missing, without root or the
``openmpi-bin`` package (``scripts/cluster_packages.sh``; CI runs it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tandem.testing.mpi import MpiHosts, mpi_hosts
from tandem.testing.netns import Unavailable

sys.path.insert(0, str(Path(__file__).parent))
from _reports import rank_reports  # noqa: E402

pytestmark = pytest.mark.procs  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_chars.py"
PROBE = Path(__file__).with_name("_probe.py")
TINY = ["--quick", "--steps", "4", "--corpus-mb", "0.1"]
SECRET = {"TANDEM_SECRET": "mpirun-test-secret"}
RANKS = ["-np", "4", "--host", "a:2,b:2", "-x", "TANDEM_SECRET"]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MpiHosts]:
    try:
        with mpi_hosts(["a", "b"], tmp_path_factory.mktemp("mpi")) as made:
            yield made
    except Unavailable as why:
        pytest.skip(str(why))


@pytest.mark.timeout(200)
def test_mpirun_ranks_join_with_nothing_set(hosts: MpiHosts) -> None:
    done = hosts.mpirun([*RANKS, sys.executable, str(PROBE)], timeout=150, env=SECRET)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = rank_reports(done.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["sum"] for r in ranks} == {10.0} and {r["world"] for r in ranks} == {4}
    assert [r["host"] for r in ranks] == ["a", "a", "b", "b"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    assert {r["MASTER_ADDR"] for r in ranks} == {hosts.addrs["a"]}  # mpirun's host, rank 0's


@pytest.mark.timeout(200)
def test_mpirun_trains_the_main_example(hosts: MpiHosts, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = hosts.mpirun([*RANKS, sys.executable, str(EXAMPLE), *TINY, "--out", str(out)],
                        timeout=150, env=SECRET)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train_chars: 4 ranks" in done.stdout
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 4


@pytest.mark.timeout(100)
def test_mpirun_without_a_secret_is_refused(hosts: MpiHosts, tmp_path: Path) -> None:
    done = hosts.mpirun(["-np", "2", "--host", "a:1,b:1", sys.executable, "-c",
                         "from tandem.config import load_secret; load_secret()"], timeout=60,
                        env={"TANDEM_SECRET": "", "XDG_CONFIG_HOME": str(tmp_path)})
    assert done.returncode != 0
    assert "python -m tandem.secret" in done.stderr, done.stderr[-3000:]
