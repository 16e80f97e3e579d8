"""Warm starts (``tandem.run.warm``): in an elastic job, a lost worker's replacement is
forked from the launcher's zygote, which has imported torch and tandem, and is a worker
like any other: the launcher's own child, its output prefixed and logged, its
environment its own, its training checked against the oracle. When the zygote cannot
serve (it has threads, it died, the workers run another program, or warm starts are
turned off) the replacement starts cold with a line saying why. No process outlives
the launcher, the zygote included, however it is stopped."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from runkit import Launch, Result, finish, wait_dead
from test_run_inplace import TRAIN, _check, _names, _results, zygotes
from tandem.run.args import parse
from tandem.run.warm import WarmPool
from tandem.run.workers import WorkerSpec, python_argv

Run = Callable[..., Result]


def _warm(out: Path) -> dict[str, tuple[int, int]]:
    """The workers that started warm: their supervisor's pid, and its parent's."""
    found = {}
    for p in out.glob("warm_*"):
        supervisor, parent = p.read_text().split()
        found[p.name[5:]] = (int(supervisor), int(parent))
    return found


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_replacement_is_forked_warm_and_is_a_worker_like_any_other(
        launch: Launch, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                  "--log-dir", logs, "--tee", "3", TRAIN, tmp_path, 30, "--kill", "1:7",
                  "--wait-full", "20", "--full", "2")
    res = finish(proc, 150)
    assert res.code == 0, res.err
    warm, names = _warm(tmp_path), _names(tmp_path)
    assert set(warm) == {"n0.s0.0", "n0.s1.0", "n0.s1.1"}, "the first workers are warm too"
    supervisor, parent = warm["n0.s1.1"]
    assert {p for _, p in warm.values()} == {proc.pid}, \
        "each warm worker's supervisor is the launcher's own child"
    results = _results(tmp_path)
    assert set(results) == {"n0.s0.0", "n0.s1.1"}
    sizes = _check(results, 30)
    assert sizes[:7] == [2] * 7 and sizes[-1] == 2, sizes
    # the same plumbing as a worker started cold: prefixed lines, log files, error file
    assert "[rank1.1]: tandem.elastic: worker n0.s1.1 admitted" in res.err, res.err
    (stderr_log,) = logs.rglob("rank_1.1/stderr.log")
    assert "worker n0.s1.1 admitted" in stderr_log.read_text()
    assert "recovered in place from 1 failure(s):" in res.err
    assert "starts cold" not in res.err and "warm starts off" not in res.err, res.err
    assert len(zygotes(res.err)) == 1, res.err
    assert not wait_dead([*zygotes(res.err), supervisor, *names.values()], 10), "outlived"


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_with_no_warm_start_replacements_start_cold(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--no-warm-start",
              TRAIN, tmp_path, 20, "--kill", "1:5", "--wait-full", "12", "--full", "2",
              timeout=150)
    assert res.code == 0, res.err
    assert not _warm(tmp_path) and "warm starts" not in res.err, res.err
    results = _results(tmp_path)
    assert set(results) == {"n0.s0.0", "n0.s1.1"} and _check(results, 20)[-1] == 2


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_zygote_with_threads_is_refused_and_the_replacement_starts_cold(
        run: Run, tmp_path: Path) -> None:
    # numpy's BLAS starts a thread pool at import when told to use 2 threads
    res = run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", TRAIN, tmp_path,
              20, "--kill", "1:5", "--wait-full", "12", "--full", "2", timeout=150,
              env={"OPENBLAS_NUM_THREADS": "2"})
    assert res.code == 0, res.err
    assert "warm starts off: the zygote failed: it has 2 threads" in res.err, res.err
    assert "worker n0.s1.1 starts cold: the zygote failed: it has 2 threads" in res.err
    assert not _warm(tmp_path)
    assert _check(_results(tmp_path), 20)[-1] == 2


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_dead_zygote_means_a_cold_start_with_a_line(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", TRAIN, tmp_path,
              20, "--kill", "1:5", "--kill-zygote", "--wait-full", "12", "--full", "2",
              timeout=150)
    assert res.code == 0, res.err
    assert re.search(r"worker n0\.s1\.1 starts cold: the zygote (failed|exited|could not "
                     r"fork a worker)", res.err), res.err
    assert set(_warm(tmp_path)) == {"n0.s0.0", "n0.s1.0"}, "only the first workers are warm"
    assert _check(_results(tmp_path), 20)[-1] == 2


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_worker_of_another_program_starts_cold(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--no-python",
              sys.executable, TRAIN, tmp_path, 20, "--kill", "1:5", "--wait-full", "12",
              "--full", "2", timeout=150)
    assert res.code == 0, res.err
    assert ("warm starts off: the worker runs a program of its own (--no-python)"
            in res.err), res.err
    assert not _warm(tmp_path) and "zygote" not in res.err
    assert _check(_results(tmp_path), 20)[-1] == 2


def _forked_by_zygote(launcher: int) -> list[int]:
    """The launcher's children that run _zygote.py: the zygote and the supervisors of the
    workers it forked (they keep its command line)."""
    found = []
    for tid in os.listdir(f"/proc/{launcher}/task"):
        for pid in Path(f"/proc/{launcher}/task/{tid}/children").read_text().split():
            try:
                if b"_zygote.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                continue
    return found


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_nothing_outlives_a_launcher_stopped_after_a_warm_replacement(
        launch: Launch, tmp_path: Path, sig: signal.Signals) -> None:
    proc = launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", TRAIN,
                  tmp_path, 100000, "--kill", "1:5", "--sleep", "0.05")
    deadline = time.monotonic() + 120
    while "n0.s1.1" not in _warm(tmp_path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no warm replacement started"
        time.sleep(0.05)
    supervisor, _ = _warm(tmp_path)["n0.s1.1"]
    forked = _forked_by_zygote(proc.pid)
    # the zygote, kept for the next failure, and the supervisors of the two live workers
    assert supervisor in forked and len(forked) == 3, forked
    pids = [*forked, *_names(tmp_path).values()]
    proc.send_signal(sig)
    res = finish(proc, 60)
    assert res.code == (128 + sig if sig != signal.SIGKILL else -sig), res.err
    assert wait_dead(pids, 10) == [], "a process outlived the launcher"


# -- which workers may start warm ------------------------------------------------------
def _spec(**changes: object) -> WorkerSpec:
    argv = python_argv("train.py", ("--lr", "1"), module=False, no_python=False,
                       supervisor=("--parent", "1"))
    spec = WorkerSpec(rank=0, local_rank=0, argv=argv, error_file="e.json",
                      env={"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0"})
    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]


def test_only_workers_of_this_interpreter_with_the_zygotes_environment_start_warm() -> None:
    pool = WarmPool(_spec(), lambda line: None)
    assert pool.unusable(_spec(env={"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "3",
                                    "TANDEM_ELASTIC_ID": "n0.s1.1"})) == ""
    module = python_argv("pkg.train", (), module=True, no_python=False, supervisor=())
    assert pool.unusable(_spec(argv=module)) == ""
    assert "--no-python" in pool.unusable(_spec(argv=python_argv(
        "prog", ("--", "-m"), module=False, no_python=True, supervisor=("--parent", "1"))))
    other = ("/usr/bin/python3.9", *_spec().argv[1:])
    assert "not this interpreter" in pool.unusable(_spec(argv=other))
    assert "differs from the zygote's in OMP_NUM_THREADS" in pool.unusable(
        _spec(env={"PATH": "/bin", "OMP_NUM_THREADS": "4", "RANK": "0"}))
    assert "differs from the zygote's in LD_PRELOAD" in pool.unusable(
        _spec(env={"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "LD_PRELOAD": "x"}))


def test_warm_starts_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(["train.py"]).warm_start
    assert not parse(["--no-warm-start", "train.py"]).warm_start
    assert not parse(["--no_warm_start", "train.py"]).warm_start
    monkeypatch.setenv("PET_NO_WARM_START", "1")
    assert not parse(["train.py"]).warm_start


@pytest.mark.procs
def test_the_zygote_refuses_to_serve_with_threads_and_says_why() -> None:
    code = ("import threading, time, sys; sys.argv = ['z']; "
            "sys.path.insert(0, %r); import _zygote; "
            "threading.Thread(target=time.sleep, args=(600,), daemon=True).start(); "
            "print(_zygote.warm_up())") % str(Path(_zygote_file()).parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "threads after importing torch" in out.stdout, out.stdout + out.stderr


def _zygote_file() -> str:
    from tandem.run import warm

    return warm.ZYGOTE
