"""tandemrun in the pods of Kubernetes training operators, on simulated hosts.

There is no Kubernetes here: each pod is a simulated host (``tandem.testing.netns``)
running the command of ``examples/kubernetes/*.yaml`` with exactly the environment the
operator gives that pod, except that node 0's DNS name (a headless Service or the
JobSet pod's name) is replaced by its address. What each operator sets:

* Kubeflow PyTorchJob, 1.8 and later (``pkg/controller.v1/pytorch``): ``MASTER_ADDR``,
  ``MASTER_PORT``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` (the master's Service and
  its ``pytorchjob-port``), ``WORLD_SIZE`` (pods x nprocPerNode), ``RANK`` and
  ``PET_NODE_RANK`` (the pod's index, master first), ``PET_NPROC_PER_NODE``,
  ``PET_NNODES``, ``PYTHONUNBUFFERED=0``; releases before 1.8 lack ``PET_MASTER_*``.
* JobSet: nothing of its own for training; Kubernetes gives an indexed Job's pods
  ``JOB_COMPLETION_INDEX``, and the manifest's pod template sets the ``PET_*`` variables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tandem.testing.netns import Unavailable, netns_lab

pytestmark = pytest.mark.procs  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "examples" / "kubernetes"
EXAMPLE = ROOT / "examples" / "train_chars.py"
TINY = ["--quick", "--steps", "4", "--corpus-mb", "0.1"]
SECRET = "kubernetes-test-secret"  # the manifests read it from a Secret


def _pytorchjob_env(pod: int, master: str, pet_master: bool) -> dict[str, str]:
    port = re.search(r"containerPort: (\d+)", (MANIFESTS / "pytorchjob.yaml").read_text())
    assert port is not None
    env = {"PYTHONUNBUFFERED": "0", "MASTER_ADDR": master, "MASTER_PORT": port.group(1),
           "WORLD_SIZE": "4", "RANK": str(pod), "PET_NPROC_PER_NODE": "2",
           "PET_NODE_RANK": str(pod), "PET_NNODES": "2", "TANDEM_SECRET": SECRET}
    if pet_master:
        env.update(PET_MASTER_ADDR=master, PET_MASTER_PORT=port.group(1))
    return env


def _jobset_env(pod: int, master: str) -> dict[str, str]:
    text = (MANIFESTS / "jobset.yaml").read_text()
    env = dict(re.findall(r'\{name: (\w+), value: "?([^"}]+?)"?\}', text))
    assert set(env) == {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR",
                        "PET_MASTER_PORT"}, env
    env.update(PET_MASTER_ADDR=master, PET_NODE_RANK=str(pod), JOB_COMPLETION_INDEX=str(pod),
               TANDEM_SECRET=SECRET)
    return env


@pytest.mark.timeout(240)
@pytest.mark.parametrize("operator", ["pytorchjob", "pytorchjob-before-1.8", "jobset"])
def test_tandemrun_trains_in_the_pods_an_operator_starts(tmp_path: Path, operator: str) -> None:
    manifest = "jobset" if operator == "jobset" else "pytorchjob"
    assert '["tandemrun", "examples/train_chars.py", "--quick"]' in \
        (MANIFESTS / f"{manifest}.yaml").read_text()
    out = tmp_path / "run"
    try:
        with netns_lab(2, tmp_path / "pods") as lab:
            def env(pod: int) -> dict[str, str]:
                if operator == "jobset":
                    return _jobset_env(pod, lab.addrs[0])
                return _pytorchjob_env(pod, lab.addrs[0], operator == "pytorchjob")

            pods = lab.run(["-m", "tandem.run"], [0, 1],
                           lambda pod: [str(EXAMPLE), *TINY, "--out", str(out)], env,
                           timeout=200, grace=30)
    except Unavailable as why:
        pytest.skip(str(why))
    logs = "\n".join(f"--- pod {p.rank} ---\n{p.log[-3000:]}" for p in pods)
    assert all(p.ok for p in pods), logs
    assert "train_chars: 4 ranks" in pods[0].log, logs
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 4
