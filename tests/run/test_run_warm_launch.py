"""The first launch is warm: every worker of a node with more than one is forked from
the launcher's zygote (``tandem.run.warm``), which imported torch and tandem once for
the node. A warm worker must see what a worker started as a new interpreter sees (its
environment, argv, ``__main__``, working directory, descriptors, signals, threads), but
random generators of its own; it fails, prints and restarts as a cold one does."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from runkit import SCRIPTS, Result
from test_run_inplace import zygotes

Run = Callable[..., Result]
FACTS = SCRIPTS / "worker_facts.py"
# what differs between any two launches, warm or not
PER_LAUNCH = {"MASTER_PORT", "TANDEM_ELASTIC_STORE", "TANDEM_ERROR_FILE", "TANDEM_JOB_MARK",
              "TANDEM_RUN_ID", "TANDEM_SECRET", "TANDEM_TRACEBACK_ONCE", "TORCHELASTIC_RUN_ID"}
RANDOM = ("torch_seed", "torch_rand", "random", "numpy")


def _facts(out: Path, ranks: int, attempt: int = 0) -> list[dict[str, Any]]:
    return [json.loads((out / f"facts_{r}_{attempt}.json").read_text()) for r in range(ranks)]


def _comparable(facts: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in facts["env"].items() if k not in PER_LAUNCH}
    return {**{k: v for k, v in facts.items() if k not in ("warm", "env", *RANDOM)},
            "env": env}


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,env", [
    ("script", {}),
    ("script", {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}),
    ("module", {"PYTHONPATH": str(SCRIPTS)}),
], ids=["script", "omp2", "module"])
def test_first_workers_start_warm_and_see_what_cold_workers_see(
        run: Run, tmp_path: Path, mode: str, env: dict[str, str]) -> None:
    target = ("-m", "worker_facts") if mode == "module" else (FACTS,)
    seen = {}
    for how in ("warm", "cold"):
        flags = ("--no-warm-start",) if how == "cold" else ()
        res = run("--standalone", "--nproc-per-node", "3", *flags, *target, tmp_path, "--x",
                  env=env, timeout=240)
        assert res.code == 0, res.err
        assert ("warm starts ready" in res.err) == (how == "warm"), res.err
        assert "start cold" not in res.err, res.err
        for r in range(3):
            assert f"[rank{r}]: rank {r} says hello" in res.out, res.out
        seen[how] = _facts(tmp_path, 3)
        for p in tmp_path.glob("facts_*.json"):
            p.unlink()
    assert [f["warm"] for f in seen["warm"]] == [True] * 3, "torch was not imported already"
    assert [f["warm"] for f in seen["cold"]] == [False] * 3
    for warm, cold in zip(seen["warm"], seen["cold"]):
        assert _comparable(warm) == _comparable(cold)
    assert [f["threads"][0] for f in seen["warm"]] == [int(env.get("OMP_NUM_THREADS", 1))] * 3
    for key in RANDOM:  # each worker's generators are its own, as in new interpreters
        for how in ("warm", "cold"):
            values = [json.dumps(f[key]) for f in seen[how]]
            assert len(set(values)) == 3, (how, key, values)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_warm_workers_failure_reads_as_a_cold_ones(run: Run, tmp_path: Path) -> None:
    shown = {}
    for how in ("warm", "cold"):
        flags = ("--no-warm-start",) if how == "cold" else ()
        res = run("--nproc-per-node", "2", *flags, SCRIPTS / "raise_on_rank.py", "1",
                  timeout=240)
        assert res.code == 1, res.err
        assert ("warm starts ready" in res.err) == (how == "warm"), res.err
        lines = res.err.splitlines()
        summary = lines[lines.index("Root cause (first failure):"):]
        shown[how] = ([line for line in lines if line.startswith("[rank1]:")],
                      [line for line in summary if line.split(":")[0].strip()
                       in ("rank", "exit", "exception", "traceback")])
    assert shown["warm"] == shown["cold"]
    traceback, summary = shown["warm"]
    assert traceback[0] == "[rank1]: Traceback (most recent call last):", traceback
    assert "raise_on_rank.py" in traceback[1] and len(traceback) == 8, traceback
    assert "ValueError: bad batch on rank 1" in traceback[-1]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_restart_forks_its_workers_from_the_same_zygote(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", FACTS, tmp_path,
              env={"FACTS_FAIL_RANK": "1"}, timeout=240)
    assert res.code == 0, res.err
    assert "restarting the workers (restart 1 of 1)" in res.err, res.err
    assert len(zygotes(res.err)) == 1, res.err
    first, second = _facts(tmp_path, 2, 0), _facts(tmp_path, 2, 1)
    assert all(f["warm"] for f in first + second)
    assert [f["env"]["TANDEM_RESTART_COUNT"] for f in second] == ["1", "1"]
    assert first[0]["torch_seed"] != second[0]["torch_seed"]


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_one_worker_per_node_starts_cold_without_a_zygote(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "1", FACTS, tmp_path, timeout=100)
    assert res.code == 0, res.err
    assert "zygote" not in res.err and not _facts(tmp_path, 1)[0]["warm"]


def _zygote_module() -> Any:
    from tandem.run import warm

    spec = importlib.util.spec_from_file_location("_zygote_for_test", warm.ZYGOTE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_the_zygotes_imports_print_is_kept_for_the_launcher() -> None:
    zygote = _zygote_module()

    def noisy() -> str:  # at the descriptor: what C code and the interpreter's stderr reach
        os.write(2, b"UserWarning: an import warning\n")
        return "why"

    assert zygote.quietly(noisy) == ("why", "UserWarning: an import warning\n")
