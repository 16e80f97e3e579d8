"""Single-node launches: a real all_reduce, the worker environment, logs and output."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from runkit import SCRIPTS, Result

Run = Callable[..., Result]


def envs(directory: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((directory / f"env_{r}.json").read_text()) for r in range(n)]


@pytest.mark.smoke("tandem.run")
@pytest.mark.procs
@pytest.mark.timeout(180)
def test_two_workers_all_reduce_with_tandem_over_env(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "2", SCRIPTS / "allreduce.py", tmp_path)
    assert res.code == 0, res.err
    assert "[rank0]: rank 0 of 2: sum 3" in res.out
    assert "[rank1]: rank 1 of 2: sum 3" in res.out


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_workers_get_the_full_environment(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc_per_node", "2", "--role", "trainer",
              "--max-restarts", "3", "--rdzv-id", "job7", SCRIPTS / "dump_env.py", tmp_path,
              "--flag")
    assert res.code == 0, res.err
    seen = envs(tmp_path, 2)
    for rank, record in enumerate(seen):
        env = record["env"]
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                                    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                                    "TANDEM_RESTART_COUNT", "TANDEM_MAX_RESTARTS",
                                    "TANDEM_RUN_ID")} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "trainer",
            "MASTER_ADDR": "127.0.0.1", "TANDEM_RESTART_COUNT": "0",
            "TANDEM_MAX_RESTARTS": "3", "TANDEM_RUN_ID": "job7"}
        assert 0 < int(env["MASTER_PORT"]) < 65536
        assert re.fullmatch(r"[0-9a-f]{64}", env["TANDEM_SECRET"])
        assert env["TANDEM_ERROR_FILE"].endswith(f"rank_{rank}/error.json")
        assert env["OMP_NUM_THREADS"] == "1"
        # torch's spellings, for scripts that resume when TORCHELASTIC_RESTART_COUNT > 0;
        # not the error file (the bootstrap records errors) nor the agent store (a torch
        # init_process_group would then look for a store tandemrun does not serve)
        assert {k: v for k, v in env.items() if k.startswith("TORCHELASTIC")} == {
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": "job7"}
        assert record["argv"][1:] == [str(tmp_path), "--flag"]
        assert record["name"] == "__main__" and record["sys_path0"] == str(SCRIPTS)
    a, b = (r["env"] for r in seen)
    assert a["MASTER_PORT"] == b["MASTER_PORT"] and a["TANDEM_SECRET"] == b["TANDEM_SECRET"]
    assert a["TANDEM_ERROR_FILE"] != b["TANDEM_ERROR_FILE"]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_user_secret_is_kept_and_pet_flags_apply(run: Run, tmp_path: Path) -> None:
    res = run(SCRIPTS / "dump_env.py", tmp_path,
              env={"TANDEM_SECRET": "mine", "PET_NPROC_PER_NODE": "3", "OMP_NUM_THREADS": "2"})
    assert res.code == 0, res.err
    seen = envs(tmp_path, 3)
    assert [r["env"]["TANDEM_SECRET"] for r in seen] == ["mine"] * 3
    assert [r["env"]["OMP_NUM_THREADS"] for r in seen] == ["2"] * 3
    assert {r["env"]["WORLD_SIZE"] for r in seen} == {"3"}


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_console_lines_are_prefixed_and_filtered(run: Run, tmp_path: Path) -> None:
    res = run("--nproc-per-node", "2", "--local-ranks-filter", "1", SCRIPTS / "dump_env.py",
              tmp_path)
    assert res.code == 0, res.err
    assert "[rank1]: stdout of rank 1" in res.out and "[rank1]: stderr of rank 1" in res.err
    assert "rank 0" not in res.out + res.err


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_log_dir_keeps_each_rank_per_attempt_and_redirect_hides_it(run: Run,
                                                                   tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = run("--nproc-per-node", "2", "--log-dir", logs, "--rdzv-id", "r1", "-r", "0:1",
              SCRIPTS / "dump_env.py", tmp_path)
    assert res.code == 0, res.err
    for rank in (0, 1):
        rank_dir = logs / "r1" / "attempt_0" / f"rank_{rank}"
        assert (rank_dir / "stdout.log").read_text() == f"stdout of rank {rank}\n"
        assert (rank_dir / "stderr.log").read_text() == f"stderr of rank {rank}\n"
    assert "stdout of rank 0" not in res.out  # redirected: file only
    assert "[rank0]: stderr of rank 0" in res.err and "[rank1]: stdout of rank 1" in res.out


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_module_and_no_python_modes(run: Run, tmp_path: Path) -> None:
    res = run("--nproc-per-node", "2", "-m", "mod_pkg.hello", "x", "-y",
              env={"PYTHONPATH": str(SCRIPTS)})
    assert res.code == 0, res.err
    assert "[rank1]: module rank 1 name __main__ args ['x', '-y']" in res.out
    res = run("--nproc-per-node", "2", "--no-python", "sh", "-c", "echo shell rank $RANK")
    assert res.code == 0, res.err
    assert "[rank0]: shell rank 0" in res.out and "[rank1]: shell rank 1" in res.out


@pytest.mark.timeout(60)
@pytest.mark.procs
def test_main_runs_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.run import main

    assert main(["--nproc-per-node", "2", str(SCRIPTS / "dump_env.py"), str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[rank0]: stdout of rank 0" in out and "[rank1]: stdout of rank 1" in out
    assert envs(tmp_path, 2)[1]["env"]["RANK"] == "1"


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_missing_script_is_refused_before_any_worker_starts(run: Run, tmp_path: Path) -> None:
    res = run(tmp_path / "nope.py")
    assert res.code == 2, res.err
    assert f"tandemrun: error: training script '{tmp_path / 'nope.py'}' not found" in res.err
    assert "[rank" not in res.out + res.err and "Root cause" not in res.err  # nothing ran
    # a module or a program is the workers' to find
    res = run("-m", "tandem_no_such_module")
    assert res.code == 1 and "No module named tandem_no_such_module" in res.err, res.err


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_given_master_port_reaches_the_workers(run: Run, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run("--nproc-per-node", "2", "--master-port", port, SCRIPTS / "dump_env.py", tmp_path)
    assert res.code == 0, res.err
    assert {e["env"]["MASTER_PORT"] for e in envs(tmp_path, 2)} == {str(port)}
