"""tandem under a real SLURM (munged, slurmctld, 2 slurmd, each node its own host).

One task per rank trains the main example through ``examples/slurm/multi_node.sbatch``
(``srun python examples/train_chars.py`` in a batch job); one tandemrun per node both
directly under ``srun`` and in the requeue and elastic templates. The fixture
(``tandem.testing.slurm``) skips, naming what is missing, without root or
the packages (``scripts/cluster_packages.sh`` installs them; CI runs it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from tandem.testing.slurm import SlurmCluster

sys.path.insert(0, str(Path(__file__).parent))
from _reports import rank_reports  # noqa: E402

pytestmark = pytest.mark.procs  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_chars.py"
PROBE = Path(__file__).with_name("_probe.py")
PY = sys.executable
TANDEMRUN = str(Path(sys.executable).with_name("tandemrun"))
# the main example, as small as it goes: the test is the launch, not the training
TINY = ["--quick", "--steps", "4", "--corpus-mb", "0.1"]
SECRET = {"TANDEM_SECRET": "slurm-test-secret"}
JOB_S = 150.0


def _no_leftovers(slurm: SlurmCluster) -> None:
    left = slurm.wait_no_leftovers(30)
    assert not left, f"processes left on the nodes: {left}"


@pytest.mark.timeout(200)
def test_srun_one_task_per_rank_derives_everything(slurm: SlurmCluster) -> None:
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=2", PY, str(PROBE)], timeout=JOB_S,
                     env=SECRET)
    ranks = rank_reports(done.stdout)
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
def test_srun_one_tandemrun_per_node_trains_the_main_example(slurm: SlurmCluster,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=1", TANDEMRUN, "--nproc-per-node", "2",
                      str(EXAMPLE), *TINY, "--out", str(out)], timeout=JOB_S, env=SECRET)
    assert "train_chars: 4 ranks" in done.stdout, done.stdout + done.stderr
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 4
    _no_leftovers(slurm)


@pytest.mark.parametrize("style", ["task per rank", "tandemrun per node"])
def test_a_multi_node_step_without_a_secret_is_refused(slurm: SlurmCluster, style: str) -> None:
    env = {"TANDEM_SECRET": "", "XDG_CONFIG_HOME": str(slurm.workdir / "home")}
    cmd = ([PY, "-c", "from tandem.config import load_secret; load_secret()"]
           if style == "task per rank" else [TANDEMRUN, "--nproc-per-node", "1", str(PROBE)])
    done = slurm.run(["srun", "-N2", "--ntasks-per-node=1", *cmd],
                     timeout=60, check=False, env=env)
    assert done.returncode != 0
    assert "python -m tandem.secret" in done.stderr, done.stderr


def _env_with_tools() -> dict[str, str]:
    """The batch scripts call python and tandemrun by name, as a user's would."""
    return {"PATH": f"{Path(PY).parent}:{os.environ['PATH']}"}


def _state(slurm: SlurmCluster, job: str) -> str:
    done = slurm.run(["scontrol", "show", "job", job], timeout=20, check=False)
    for word in done.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return ""


def _wait_for(what: str, ready: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
            raise AssertionError(f"no {what} within {timeout:.0f} s; the job's log:\n{text}")
        time.sleep(0.2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("template", ["one_node", "multi_node"])
def test_the_batch_templates_train_the_main_example(slurm: SlurmCluster, tmp_path: Path,
                                                    template: str) -> None:
    log, out = tmp_path / "job.out", tmp_path / "run"
    done = slurm.run(["sbatch", "--wait", f"--output={log}",
                      str(ROOT / "examples" / "slurm" / f"{template}.sbatch"), *TINY,
                      "--out", str(out)], timeout=JOB_S, env=_env_with_tools(), cwd=ROOT,
                     check=False)
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-4000:] + done.stderr
    world = 2 if template == "one_node" else 4
    assert f"train_chars: {world} ranks" in text
    assert json.loads((out / "metrics.json").read_text())["world_size"] == world
    _no_leftovers(slurm)


@pytest.mark.timeout(200)
def test_scancel_stops_every_rank_on_every_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=2\n"
                      "export TANDEM_SECRET=$(python -m tandem.secret)\n"
                      f"srun tandemrun --nproc-per-node 2 {PROBE.with_name('_forever.py')}\n")
    job = slurm.run(["sbatch", "--parsable", f"--output={log}", str(script)], timeout=60,
                    env=_env_with_tools()).stdout.strip()
    _wait_for("4 running ranks", lambda: log.exists() and log.read_text().count("running") == 4,
              JOB_S, log)
    slurm.run(["scancel", job], timeout=30)
    _wait_for("cancelled job", lambda: _state(slurm, job) == "CANCELLED", 60, log)
    _no_leftovers(slurm)


@pytest.mark.timeout(300)
def test_a_preemption_warning_checkpoints_and_the_requeued_job_resumes(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    log, out = tmp_path / "job.out", tmp_path / "run"
    steps = 40  # ~0.2 s a step here: the warning lands within a few steps of step 2
    job = slurm.run(["sbatch", "--parsable", f"--output={log}",
                     str(ROOT / "examples" / "slurm" / "requeue.sbatch"), *TINY,
                     "--steps", str(steps), "--save-every", "2"], timeout=60, cwd=ROOT,
                    env={**_env_with_tools(), "TRAIN_CHARS_OUT": str(out)}).stdout.strip()
    # a checkpoint exists once every rank is in the training loop, its handler installed
    _wait_for("first checkpoint", lambda: (out / "checkpoint.pt").exists(), JOB_S, log)
    slurm.run(["scancel", "--signal=USR1", job], timeout=30)  # what --signal=USR1@60 sends
    _wait_for("preemption note", lambda: (out / "preempted.json").exists()
              or (out / "metrics.json").exists(), 60, log)
    stopped_at = json.loads((out / "preempted.json").read_text())["step"]
    assert 2 <= stopped_at < steps
    _wait_for("resumed run's metrics", lambda: (out / "metrics.json").exists(), JOB_S, log)
    text = log.read_text(errors="replace")
    assert f"preempted (SIGUSR1) after step {stopped_at} of {steps}" in text
    assert f"resuming at step {stopped_at} (--resume)" in text, text[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["steps"], metrics["steps_this_run"]) == (steps, steps - stopped_at)
    assert not (out / "preempted.json").exists()
    _wait_for("completed job", lambda: _state(slurm, job) == "COMPLETED", 60, log)
    _no_leftovers(slurm)


def _worker_of_rank(slurm: SlurmCluster, host: int, rank: int, log: Path) -> int:
    """The training process of ``rank`` on ``host``, as the elastic example names it (its
    membership line: "rank R pid P"). Warm workers are forked from a zygote, so neither
    their command line nor /proc/PID/environ says which rank they are."""
    found: list[int] = []

    def named() -> bool:
        if not log.exists():
            return False
        found[:] = [int(p) for line in log.read_text(errors="replace").splitlines()
                    if "(kill -9" in line
                    for r, p in re.findall(r"rank (\d+) pid (\d+)", line) if int(r) == rank]
        return bool(found)

    _wait_for(f"rank {rank}'s pid in the membership line", named, JOB_S, log)
    pid = found[-1]
    assert pid in slurm.lab.pids(host), f"rank {rank} (pid {pid}) is not on host {host}"
    return pid


@pytest.mark.timeout(300)
def test_the_elastic_template_replaces_a_killed_rank_in_place(slurm: SlurmCluster,
                                                              tmp_path: Path) -> None:
    log, out = tmp_path / "job.out", tmp_path / "run"
    steps = 60
    job = slurm.run(["sbatch", "--parsable", f"--output={log}",
                     str(ROOT / "examples" / "slurm" / "elastic.sbatch"), *TINY, "--steps",
                     str(steps), "--save-every", "5", "--out", str(out)], timeout=60,
                    cwd=ROOT, env=_env_with_tools()).stdout.strip()
    _wait_for("first checkpoint", lambda: (out / "checkpoint.pt").exists(), JOB_S, log)
    os.kill(_worker_of_rank(slurm, 2, 3, log), signal.SIGKILL)  # rank 3 lives on node2
    _wait_for("completed job", lambda: _state(slurm, job) in ("COMPLETED", "FAILED"), JOB_S,
              log)
    text = log.read_text(errors="replace")
    assert _state(slurm, job) == "COMPLETED", text[-4000:]
    assert "recovered in place from 1 failure(s)" in text, text[-4000:]
    assert "rank 3 (local_rank 1, host node2): signal 9 (SIGKILL)" in text
    metrics = json.loads((out / "metrics.json").read_text())
    # the survivors go on at once; the replacement joins unless the run ends first
    assert metrics["steps"] == steps and metrics["world_size"] in (3, 4), metrics
    _no_leftovers(slurm)
