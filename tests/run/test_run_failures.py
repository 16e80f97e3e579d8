"""Worker failures: the root-cause summary, restarts, and choosing the first failure."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from runkit import SCRIPTS, Result
from tandem.run.rootcause import Failure, describe_exit, format_summary, pick_root_cause

Run = Callable[..., Result]


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrapped", [[], ["record"]], ids=["plain", "torchs_record"])
def test_an_exception_is_reported_with_rank_type_message_and_traceback(
        run: Run, wrapped: list[str]) -> None:
    res = run("--nproc-per-node", "2", SCRIPTS / "raise_on_rank.py", "1", *wrapped)
    assert res.code == 1
    summary = res.err[res.err.index("Root cause"):]
    assert "rank       : 1 (local_rank 1, node 0, role default)" in summary
    assert "exit       : exit code 1" in summary
    assert "exception  : ValueError: bad batch on rank 1" in summary
    assert "traceback  : printed above by [rank1]" in summary  # not a second time
    assert res.err.count('raise_on_rank.py", line 8, in load_batch') == 1
    assert "_worker.py" not in res.err and "runpy" not in res.err
    assert "Stopped by the launcher: ranks 0" in summary
    assert "[rank1]: ValueError: bad batch on rank 1" in res.err  # the worker's own stderr


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_the_summary_prints_a_traceback_that_did_not_reach_the_console(run: Run) -> None:
    res = run("--nproc-per-node", "2", "--redirects", "2", SCRIPTS / "raise_on_rank.py", "1")
    assert res.code == 1
    summary = res.err[res.err.index("Root cause"):]
    assert 'raise_on_rank.py", line 8, in load_batch' in summary


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_the_cause_still_unwinding_is_the_root_cause_not_a_stopped_rank(run: Run) -> None:
    # rank 0 raises, leaves the group and takes a second in its finally block; rank 1
    # fails at once of the consequence. Stopped at once, rank 0 had no record yet.
    res = run("--nproc-per-node", "2", SCRIPTS / "slow_cause.py")
    assert res.code == 1
    summary = res.err[res.err.index("Root cause"):]
    assert "rank       : 0 (local_rank 0" in summary, summary
    assert "exit       : exit code 1" in summary
    assert "exception  : ValueError: the real cause, on rank 0" in summary
    assert "rank 1 (local_rank 1, host" in summary and "PeerLostError" in summary
    assert "Stopped by the launcher" not in summary


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_rank_exiting_after_its_exception_is_not_reported_as_killed(run: Run) -> None:
    # rank 0 raised first and is running a slow exit handler when rank 1 fails
    res = run("--nproc-per-node", "2", SCRIPTS / "slow_exit.py")
    assert res.code == 1
    summary = res.err[res.err.index("Root cause"):]
    assert "rank       : 0 (local_rank 0" in summary, summary
    assert "exit       : exit code 1" in summary, summary
    assert "exception  : ValueError: first, on rank 0" in summary
    assert "rank 1 (local_rank 1, host" in summary and "KeyError" in summary


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_killed_worker_is_reported_with_its_signal(run: Run, tmp_path: Path) -> None:
    res = run("--nproc-per-node", "2", "--log-dir", tmp_path / "logs",
              SCRIPTS / "sigkill_on_rank.py", "0")
    assert res.code == 1
    assert "rank       : 0 (local_rank 0" in res.err
    assert "exit       : signal 9 (SIGKILL)" in res.err
    assert "exception  : none recorded" in res.err
    assert f"logs       : {tmp_path / 'logs'}" in res.err


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_transient_failure_is_survived_with_one_restart(run: Run, tmp_path: Path) -> None:
    res = run("--nproc-per-node", "2", "--max-restarts", "1", SCRIPTS / "fail_first_attempt.py",
              "1", tmp_path)
    assert res.code == 0, res.err
    assert "attempt 0 failed (rank 1" in res.err and "restart 1 of 1" in res.err
    assert "[rank0]: rank 0 done on attempt 1" in res.out
    assert "[rank1]: rank 1 done on attempt 1" in res.out
    ports = {(tmp_path / f"attempt{a}_rank1").read_text() for a in (0, 1)}
    assert len(ports) == 2  # each attempt has its own MASTER_PORT


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_giving_up_after_max_restarts(run: Run, tmp_path: Path) -> None:
    res = run("--nproc-per-node", "2", "--max-restarts", "1", SCRIPTS / "raise_on_rank.py", "0")
    assert res.code == 1
    assert "restart 1 of 1" in res.err and "failed after 2 attempts" in res.err
    assert res.err.count("Root cause") == 1


def failure(rank: int, t: float, exc: str = "", code: int = 1) -> Failure:
    return Failure(rank=rank, local_rank=rank, node_rank=0, host="h", pid=100 + rank, time=t,
                   returncode=code, exc_type=exc, message="m", traceback="tb\n")


def test_root_cause_is_the_earliest_failure() -> None:
    assert pick_root_cause([failure(0, 2.0, "ValueError"), failure(1, 1.0, "KeyError")]).rank == 1


def test_a_lost_peer_is_a_consequence_not_the_root_cause() -> None:
    lost = failure(0, 1.0, "tandem.errors.PeerLostError")
    killed = failure(1, 1.01, code=-9)
    assert pick_root_cause([lost, killed]).rank == 1
    assert pick_root_cause([lost]).rank == 0


def test_summary_lists_every_failure() -> None:
    text = format_summary([failure(0, time.time(), "ValueError"), failure(1, time.time() + 1)],
                          run_id="abc", attempts=3, stopped=[2, 3])
    assert "job abc failed after 3 attempts" in text
    assert "Other failures:\n  rank 1 (local_rank 1, host h): exit code 1" in text
    assert "Stopped by the launcher: ranks 2-3" in text
    assert describe_exit(-15) == "signal 15 (SIGTERM)" and describe_exit(None).startswith("exit")


def test_the_summary_of_64_failing_ranks_is_one_screen_and_names_the_cause() -> None:
    # rank 13 raised; the 63 others lost it (as tandemrun at 8 hosts x 8 sees it), with
    # long messages naming each reporter, and two stopped by the launcher
    cause = failure(13, 100.0, "ValueError")
    lost = [Failure(rank=r, local_rank=r % 8, node_rank=r // 8, host=f"h{r // 8}", pid=r,
                    time=100.5 + r / 100, returncode=-15,
                    exc_type="tandem.errors.PeerLostError",
                    message=f"rank 13 died (reported by rank {r}): all_reduce #3 on group "
                            f"'default' (rank {r} of 64) failed: " + "x" * 300)
            for r in range(64) if r not in (13, 40, 41)]
    lost[5].returncode = 1  # one of another kind
    text = format_summary([cause, *lost], run_id="j", attempts=1, stopped=[40, 41])
    lines = text.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 240, text
    assert "  rank       : 13 (local_rank 13, node 0, role default)" in text
    assert "  ranks 3-4, 6-12, 14-39, 42-63 (57 more): signal 15 (SIGTERM), PeerLostError" \
        in lines, text
    assert "  rank 5 (1 more): exit code 1, PeerLostError" in lines, text
    assert lines[-2] == "Stopped by the launcher: ranks 40-41", text


def test_failures_travel_between_nodes_as_json() -> None:
    f = failure(3, 5.0, "ValueError")
    assert Failure.from_json(f.to_json()) == f


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_restarted_job_resumes_from_its_checkpoint(run: Run, tmp_path: Path) -> None:
    steps = 6
    res = run("--nproc-per-node", "2", "--max-restarts", "1", SCRIPTS / "checkpointed.py",
              tmp_path / "ckpt.pt", steps, timeout=170)
    assert res.code == 0, res.err
    assert "[rank0]: rank 0 resumed at step 3" in res.out
    # w -= 0.1 * mean over ranks of (rank + 1 + step), for every step, exactly once
    expected = -sum(0.1 * ((1 + step) + (2 + step)) / 2 for step in range(steps))
    assert f"[rank0]: rank 0 final {expected:.4f}" in res.out
    assert f"[rank1]: rank 1 final {expected:.4f}" in res.out


@pytest.mark.timeout(90)
@pytest.mark.procs
def test_the_root_cause_is_the_rank_that_stalled_not_the_one_that_reported_it(run: Run) -> None:
    res = run("--nproc-per-node", "3", SCRIPTS / "stalls_in_loader.py")
    assert res.code == 1
    summary = res.err[res.err.index("Root cause"):]
    assert summary.startswith("Root cause: rank 2 stopped making progress\n"
                              "  rank       : 2 (still running when the launcher stopped it)\n"
                              "  seen by    : rank"), summary
    assert "First failure it caused:\n  rank       : " in summary
    assert "CollectiveTimeoutError" in summary and "Stopped by the launcher: ranks 2" in summary


def test_a_timeout_blames_a_stopped_rank_only_when_it_did_not_fail_itself() -> None:
    timed_out = failure(1, 1.0, "tandem.errors.CollectiveTimeoutError")
    timed_out.blames = [2]
    text = format_summary([timed_out], run_id="j", attempts=1, stopped=[0, 2])
    assert text.splitlines()[2] == "Root cause: rank 2 stopped making progress"
    assert "  seen by    : rank 1, which timed out waiting for it" in text
    died = failure(2, 0.5, code=-9)  # the blamed rank failed by itself: it is the cause
    assert "Root cause (first failure):\n  rank       : 2" in format_summary(
        [timed_out, died], run_id="j", attempts=1, stopped=[0])
    # a blamed rank that exited cleanly, or was never seen stopped here, is not guessed at
    assert "Root cause (first failure):\n  rank       : 1" in format_summary(
        [timed_out], run_id="j", attempts=1, stopped=[0])


def test_the_bootstrap_records_the_ranks_a_timeout_names(tmp_path: Path) -> None:
    import importlib.util
    import json

    from tandem.errors import CollectiveTimeoutError
    from tandem.run import _tracebacks
    spec = importlib.util.spec_from_file_location(
        "bootstrap", Path(_tracebacks.__file__).with_name("_worker.py"))
    assert spec and spec.loader
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)
    try:
        try:
            raise CollectiveTimeoutError("all_reduce timed out", missing=(3, 2))
        except CollectiveTimeoutError as exc:
            raise RuntimeError("the step failed") from exc
    except RuntimeError as wrapped:
        bootstrap.record_error(wrapped, str(tmp_path / "e.json"), False, _tracebacks, 1.0)
    assert json.loads((tmp_path / "e.json").read_text())["blames"] == [2, 3]


def _memory_cgroup(limit: int) -> Path | None:
    """A new memory cgroup limited to ``limit`` bytes (v1 or v2), or None where none can be
    made here (not root, no memory controller)."""
    import uuid
    for root, knob in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                       (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / knob).exists() and not (root / "cgroup.controllers").exists():
            continue
        if knob == "memory.max" and "memory" not in (root / "cgroup.controllers").read_text():
            continue
        path = root / f"tandem-test-oom-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
            (path / knob).write_text(str(limit))
        except OSError:
            if path.exists():
                path.rmdir()
            continue
        return path
    return None


@pytest.mark.timeout(90)
@pytest.mark.procs
def test_a_worker_the_oom_killer_killed_is_said_to_be(run: Run) -> None:
    import os
    if os.geteuid() != 0:
        pytest.skip("needs root: the kernel log and a memory cgroup")
    cgroup = _memory_cgroup(64 << 20)
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (no memory controller)")
    try:
        os.environ["OOM_CGROUP"] = str(cgroup)
        res = run("--nproc-per-node", "2", SCRIPTS / "oom_on_rank.py")
    finally:
        del os.environ["OOM_CGROUP"]
        cgroup.rmdir()
    assert res.code == 1
    summary = res.err[res.err.index("Root cause"):]
    assert "rank       : 1 (local_rank 1" in summary and "signal 9 (SIGKILL)" in summary
    assert "exception  : none recorded: the kernel's OOM killer killed it (out of memory); " \
           "the kernel log says: " in summary, summary
    assert "Killed process" in summary


def test_a_kernel_log_line_counts_only_for_its_own_process_and_time(tmp_path: Path) -> None:
    from tandem.run.oom import oom_kill_line
    now = time.monotonic()
    log = tmp_path / "kmsg"  # /dev/kmsg's format: priority,sequence,microseconds,flags;text

    def line(pid: int, ago: float) -> str:
        return (f"3,{pid},{int((now - ago) * 1e6)},-;Memory cgroup out of memory: Killed "
                f"process {pid} (python) total-vm:100kB\n SUBSYSTEM=memory\n")
    log.write_text(line(4242, 2.0) + line(42, 1.0) + line(77, 3600.0))
    exit_time = time.time()
    assert oom_kill_line(4242, exit_time, kmsg=str(log)).startswith(
        "Memory cgroup out of memory: Killed process 4242 (python)")
    assert oom_kill_line(424, exit_time, kmsg=str(log)) == ""  # a prefix of another pid
    assert oom_kill_line(77, exit_time, kmsg=str(log)) == ""  # an hour old: an earlier process
    assert oom_kill_line(42, exit_time, kmsg=str(tmp_path / "none")) == ""  # unreadable
