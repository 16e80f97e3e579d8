"""tandem.ray on a real 2-node Ray cluster (head and worker in their own namespaces), and
on the local Ray that ``ray.init()`` starts by default; the main example runs on both.

The drivers (``_ray_driver.py``) run on the head node. One cluster serves the module
(about 45 s to start on a loaded machine): the tests are few and each one a whole job.
Skips, naming what is missing, without root or Ray (``scripts/setup.sh`` installs it);
fails instead in CI (``CI=true``), which runs as root and installs Ray.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator, NoReturn

import pytest

from tandem.testing.netns import Unavailable
from tandem.testing.ray import RayCluster, ray_cluster

pytestmark = pytest.mark.procs  # every test here starts processes

DRIVER = Path(__file__).with_name("_ray_driver.py")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_train_chars.py"
TINY = ["--quick", "--steps", "4", "--corpus-mb", "0.1"]


@pytest.fixture(scope="module")  # torn down with its module: every Ray process, by pid
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    try:
        with ray_cluster(2, tmp_path_factory.mktemp("ray")) as made:
            yield made
    except Unavailable as why:
        _unavailable(str(why))


def _unavailable(why: str) -> NoReturn:
    if os.environ.get("CI") == "true":  # CI installs Ray and runs as root: never skip there
        pytest.fail(f"the Ray tests cannot run in CI: {why}")
    pytest.skip(why)


def _drive(cluster: RayCluster, *args: str, timeout: float = 400) -> tuple[dict[str, Any], str]:
    done = cluster.run([sys.executable, str(DRIVER), *args], timeout=timeout, check=False)
    out = done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, out[-5000:]
    return json.loads(lines[-1][len("RESULT "):]), out


@pytest.mark.timeout(900)
def test_two_nodes_train_the_main_example_with_ranks_from_where_actors_landed(
        cluster: RayCluster, tmp_path: Path) -> None:
    done = cluster.run([sys.executable, str(EXAMPLE), "--workers", "4", "--strategy", "SPREAD",
                        *TINY, "--out", str(tmp_path / "run")], timeout=600, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    ranks = [m.groups() for m in re.finditer(
        r"ray_train_chars: rank (\d) ran on (\S+) \(local rank (\d) of (\d)\), "
        r"rendezvous at (\S+)", done.stdout)]
    # SPREAD over 2 nodes of 2 CPUs: 2 actors each (bundle 0, so rank 0, may land on
    # either); a node's ranks are contiguous, and the rendezvous is on rank 0's node
    assert [r[0] for r in ranks] == ["0", "1", "2", "3"], out[-3000:]
    hosts = [r[1] for r in ranks]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) == {"node1", "node2"}
    assert [(r[2], r[3]) for r in ranks] == [("0", "2"), ("1", "2"), ("0", "2"), ("1", "2")]
    rank0_addr = cluster.addrs[int(hosts[0].removeprefix("node")) - 1]
    assert {r[4] for r in ranks} == {rank0_addr}
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["world_size"] == 4
    assert "[rank0]: train_chars: 4 ranks" in out, out[-3000:]  # streamed, rank-prefixed
    assert "TANDEM_SECRET" not in out


@pytest.mark.timeout(600)
def test_a_killed_actor_is_named_with_its_rank_node_and_how_it_ended(
        cluster: RayCluster) -> None:
    result, out = _drive(cluster, "kill")
    assert result["error"] == "WorkerFailedError", result
    # STRICT_SPREAD: the two ranks on different nodes, either one on either
    named = re.match(r"tandem\.ray: rank 1 \(node (\S+), host node(\d), pid \d+\) died: its "
                     r"actor's process ended", result["message"])
    assert named, result["message"]
    assert named.group(1) == cluster.addrs[int(named.group(2)) - 1]  # the node's own address
    assert result["rank"] == 1 and result["node"] == named.group(1), result
    assert "then rank 0" in result["message"]  # after it: the rank that lost its peer
    assert "[rank1]: rank 1 kills its own actor" in out  # its output reached the driver


@pytest.mark.timeout(900)
def test_with_elastic_a_killed_actor_is_replaced_and_training_matches_the_oracle(
        cluster: RayCluster) -> None:
    # the driver checks every rank's parameters against the one-process oracle trained
    # along the membership schedule, and fails if they differ
    result, out = _drive(cluster, "elastic")
    assert result["replaced"] == 1 and len(result["failures"]) == 1, result
    assert result["failures"][0].startswith("rank 1 (node "), result
    assert result["names"] == ["w0.0", "w1.1"]  # slot 1 holds the replacement
    assert result["worlds"] == [2, 2]  # it was let in before the end
    sizes = [world for _, world, _ in result["history"]]
    assert 1 in sizes and sizes[-1] == 2, sizes  # trained alone for a while, then as 2
    assert "a replacement starts now" in out
    # one secret for the job, the replacement's included, made by the driver and
    # written nowhere: not in the driver's output, not in any log of the Ray cluster
    (secret,) = set(result["secrets"])
    assert len(secret) == 64
    shown = "\n".join(ln for ln in out.splitlines() if not ln.startswith("RESULT "))
    assert secret not in shown
    logged = [f for f in cluster.temp.rglob("*") if _holds(f, secret.encode())]
    assert not logged, logged


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.is_file() and data in path.read_bytes()
    except OSError:  # a socket, or a file Ray removed meanwhile
        return False


@pytest.mark.timeout(300)
def test_more_strict_spread_workers_than_nodes_are_refused_at_once(cluster: RayCluster) -> None:
    result, _ = _drive(cluster, "refuse")
    assert result["error"] == "ArgumentError"
    assert "STRICT_SPREAD" in result["message"] and "2 alive" in result["message"]


@pytest.mark.timeout(600)
def test_without_an_address_fit_starts_ray_on_this_machine(tmp_path: Path) -> None:
    # a host of its own with no Ray running, no RAY_ADDRESS and a fresh Ray temp
    # directory: ray.init() finds no cluster and starts one, which fit() shuts down
    try:
        with ray_cluster(1, tmp_path / "host", start=False) as host:
            done = host.run([sys.executable, str(EXAMPLE), "--workers", "2", *TINY, "--out",
                             str(tmp_path / "run")], timeout=500, check=False, local=True)
            left = _leftovers(host)  # nothing of the local Ray outlives its driver
    except Unavailable as why:
        _unavailable(str(why))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "Started a local Ray instance" in out, out[-3000:]
    assert len(re.findall(r"ray_train_chars: rank \d ran on node1 \(local rank \d of 2\)",
                          done.stdout)) == 2, out[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["world_size"] == 2
    assert not left, left


def _leftovers(host: RayCluster, timeout: float = 30.0) -> list[str]:
    """The processes still running on the host once none are, or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in host.lab.pids(0):
            try:
                left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                            .decode(errors="replace")[:200])
            except OSError:
                pass  # gone meanwhile
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
