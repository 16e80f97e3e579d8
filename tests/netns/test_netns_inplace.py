"""In-place recovery across simulated hosts: two tandemrun agents, each in its own
network namespace with 2 workers, run ``tests/run/scripts/elastic_train.py``; the
worker that started as rank 2 (host 1) SIGKILLs itself at step 7, and the one that
started as rank 1 (host 0) at step 25, after the first replacement joined; both in
backward, during the gradient all-reduce, or in the optimizer step. The survivors on both hosts go on in the same processes, each host's agent
starts a replacement, which joins over tcp from its namespace (the second one then
reaches the first one: a joiner must listen on its host's address, not on the
loopback of its world before admission), and the parameters of every finisher equal
the oracle's for the steps applied. Needs root and iproute2 (skips, saying why,
elsewhere). About 30 s per kill point on 2 cores.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.testing.netns import RankRun, Unavailable, netns_lab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "elastic"))
from _elastic_job import check_against_oracle  # noqa: E402

pytestmark = pytest.mark.procs

TRAIN = Path(__file__).resolve().parents[1] / "run" / "scripts" / "elastic_train.py"
STEPS = 50
KILLS = {"2": 7, "1": 25}  # the rank a worker started as: the step it dies in
WAIT_FULL = (20, 40)  # steps where training waits for the replacement


def _agents(workdir: Path, where: str) -> list[RankRun]:
    secret = secrets.token_hex(16)
    out = workdir / "out"
    out.mkdir()
    try:
        with netns_lab(2, workdir) as lab:
            def args(node: int) -> list[str]:
                return ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                        # a fixed port is safe: the lab's namespaces are private
                        "--master-addr", lab.addrs[0], "--master-port", "29677",
                        "--max-restarts", "2", str(TRAIN), str(out), str(STEPS), "--full", "4",
                        *(a for r, s in KILLS.items() for a in ("--kill", f"{r}:{s}")),
                        *(a for s in WAIT_FULL for a in ("--wait-full", str(s))),
                        "--kill-where", where]

            def env(node: int) -> dict[str, str]:
                return {"TANDEM_SECRET": secret, "TANDEM_HOST_ID": f"nshost{node}",
                        "TANDEM_CONNECT_TIMEOUT": "30", "TANDEM_TIMEOUT": "60",
                        "TANDEM_TRACE_DIR": str(workdir / "trace")}

            return lab.run(["-m", "tandem.run"], [0, 1], args, env, timeout=150, grace=30)
    except Unavailable as exc:
        pytest.skip(f"network namespaces are unavailable: {exc}")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["backward", "allreduce", "optimizer"])
def test_a_worker_killed_on_one_host_is_replaced_in_place_across_hosts(tmp_path: Path,
                                                                        where: str) -> None:
    node0, node1 = _agents(tmp_path, where)
    logs = f"--- node 0 ---\n{node0.log[-4000:]}\n--- node 1 ---\n{node1.log[-4000:]}"
    assert node0.ok and node1.ok, logs
    out = tmp_path / "out"
    names = {p.name[5:]: int(p.read_text()) for p in out.glob("name_*")}
    results: dict[str, dict[str, Any]] = {p.name[7:-3]: torch.load(p, weights_only=True)
                                          for p in out.glob("result_*.pt")}
    assert set(names) == {"n0.s0.0", "n0.s1.0", "n1.s0.0", "n1.s1.0", "n1.s0.1",
                          "n0.s1.1"}, names
    assert set(results) == {"n0.s0.0", "n1.s1.0", "n1.s0.1", "n0.s1.1"}, logs
    for survivor in ("n0.s0.0", "n1.s1.0", "n1.s0.1"):
        assert results[survivor]["pid"] == names[survivor], survivor
    history = check_against_oracle(list(results.values()))
    sizes = [w for _, w, _ in history]
    assert len(sizes) == STEPS, history
    assert set(sizes) <= {3, 4} and sizes[0] == sizes[-1] == 4, f"{history}\n{logs}"
    # After each kill the survivors go on with 3 ranks until the replacement is let in at
    # a commit, by the step where training waits for it at the latest. A replacement
    # already queued when the recovery round closes is let in by that round, and no step
    # runs with 3 ranks (seen once in a full suite run: a warm start beat the survivors
    # noticing the loss). The names, results and logs checked here show both kills.
    threes = [i for i, w in enumerate(sizes) if w == 3 and (i == 0 or sizes[i - 1] == 4)]
    # killed in backward, before its gradients were sent, the step runs again with fewer
    # ranks; killed once they were sent (all-reduce, optimizer), the step may stand with
    # every rank's gradient (the oracle check above holds either way)
    late = (0,) if where == "backward" else (0, 1)
    for start in threes:
        kill, full = (7, WAIT_FULL[0]) if start < 25 else (25, WAIT_FULL[1])
        assert start - kill in late, sizes
        assert sizes.index(4, start) <= full, sizes
    assert len({start < 25 for start in threes}) == len(threes), sizes  # one per kill
    for node, rank in ((node0, 1), (node1, 2)):
        assert "recovered in place from 1 failure(s):" in node.log, logs
        assert f"rank {rank} (local_rank {rank % 2}, host" in node.log, logs
        assert "signal 9 (SIGKILL)" in node.log and "a replacement starts now" in node.log
