"""Nothing a job starts outlives it, however the launcher ends.

Each worker of these jobs starts three helpers the way real jobs do (a plain child,
one in a session of its own, a double-forked daemon; ``scripts/spawn_helpers.py``).
The launcher is then SIGKILLed, SIGTERMed, or its workers just exit; every helper
must be gone, and so must the launcher's scratch directory and the job's cgroup.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from runkit import SCRIPTS, Launch, finish, process_alive, wait_dead, wait_for_pids
from tandem.run import _reaper, containment
from tandem.run.workers import BOOTSTRAP

pytestmark = pytest.mark.timeout(120)
HELPERS = ("plain", "session", "daemon")


def kids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in directory.glob("kid_*") if not p.name.endswith(".tmp")]


@pytest.fixture
def reap_kids(tmp_path: Path) -> Iterator[None]:
    """Whatever happens, no helper of a test outlives it."""
    yield
    for pid in kids(tmp_path):
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def started(directory: Path, workers: int, proc: subprocess.Popen[str]) -> list[int]:
    """Wait until every worker noted its pid and its helpers'; all of those pids."""
    pids = wait_for_pids(directory, workers, proc) + kids(directory)
    assert len(pids) == workers * (1 + len(HELPERS)) and all(map(process_alive, pids))
    return pids


def scratch_of(directory: Path) -> Path:
    """The launcher's scratch directory (the workers' error files are below it)."""
    rank_dir = Path((directory / "scratch_0").read_text())
    return next(p for p in rank_dir.parents if p.name.startswith("tandemrun_"))


def job_cgroups(launcher: int) -> list[str]:
    try:
        parent = containment._own_cgroup()
    except OSError:
        return []
    return [n for n in os.listdir(parent) if n.startswith(f"tandemrun-{launcher}.")]


@pytest.mark.procs
def test_nothing_survives_a_sigkilled_launcher(launch: Launch, tmp_path: Path,
                                                reap_kids: None) -> None:
    proc = launch("--nproc-per-node", "2", SCRIPTS / "spawn_helpers.py", tmp_path)
    pids = started(tmp_path, 2, proc)
    scratch = scratch_of(tmp_path)
    assert scratch.is_dir()
    supervisors = [parent_of(pid) for pid in pids[:2]]  # the workers' parents
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, 30)
    assert wait_dead(pids, 15) == [], "outlived the launcher"
    # each supervisor removes the scratch directory once all below it is dead, then its
    # cgroup, which may take up to its KILL_TIMEOUT (10 s)
    deadline = time.monotonic() + 25
    while (scratch.exists() or job_cgroups(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not scratch.exists(), (f"{scratch} was left behind: it holds "
                                  f"{sorted(str(p.relative_to(scratch)) for p in scratch.rglob('*'))}"
                                  f"; supervisors {supervisors}: {describe(supervisors)}")
    assert job_cgroups(proc.pid) == []


# the launcher where no cgroup can be made (cgroup v1 hosts, no write access)
NO_CGROUP = ("from tandem.run import containment\n"
             "def unmounted():\n"
             "    raise OSError('no cgroup v2 hierarchy is mounted')\n"
             "containment._own_cgroup = unmounted\n"
             "import runpy\n"
             "runpy.run_module('tandem.run', run_name='__main__', alter_sys=True)\n")


@pytest.mark.procs
def test_nothing_survives_the_launcher_and_every_supervisor_killed(tmp_path: Path,
                                                                   reap_kids: None) -> None:
    """SIGKILL of the launcher and of each supervisor leaves no process of the job to kill
    the helpers (without a cgroup): the job's reaper does, once they are all gone."""
    proc = subprocess.Popen([sys.executable, "-c", NO_CGROUP, "--nproc-per-node", "2",
                             str(SCRIPTS / "spawn_helpers.py"), str(tmp_path)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        pids = started(tmp_path, 2, proc)
        supervisors = [parent_of(pid) for pid in pids[:2]]  # the workers' parents
        for pid in supervisors:  # stopped first: none may start its clean-up
            os.kill(pid, signal.SIGSTOP)
        for pid in [proc.pid, *supervisors]:
            os.kill(pid, signal.SIGKILL)
        res = finish(proc, 30)
        assert "no cgroup: no cgroup v2 hierarchy is mounted" in res.err, res.err
        left = wait_dead(pids, 30)
        assert left == [], f"outlived the launcher and the supervisors: {describe(left)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


@pytest.mark.procs
def test_the_reaper_kills_only_its_own_job(tmp_path: Path) -> None:
    """Only processes whose environment holds exactly this job's mark are killed."""
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    env = {k: v for k, v in os.environ.items() if k != _reaper.MARK}
    procs = {mark: subprocess.Popen(sleep, env={**env, _reaper.MARK: mark} if mark else env)
             for mark in ("job-1", "job-10", "job", "")}
    try:
        killed = _reaper.sweep("job-1", timeout=30)
        assert procs["job-1"].wait(30) == -signal.SIGKILL
        assert killed == [procs["job-1"].pid]
        assert all(p.poll() is None for m, p in procs.items() if m != "job-1")
    finally:
        for p in procs.values():
            p.kill()
            p.wait(30)


@pytest.mark.procs
def test_a_new_reaper_sweeps_jobs_whose_launcher_and_reaper_are_gone() -> None:
    """Should a job's reaper be killed with the rest, the next launcher's reaper kills what
    that job left; a job whose launcher lives is never touched."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # a launcher pid that no process has any more
    ns = containment._pid_namespace()
    dead_job, live_job = f"{gone.pid}.{ns}-{os.urandom(8).hex()}", f"{os.getpid()}.{ns}-x1"
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    env = {k: v for k, v in os.environ.items() if k != _reaper.MARK}
    procs = {mark: subprocess.Popen(sleep, env={**env, _reaper.MARK: mark})
             for mark in (dead_job, live_job)}
    try:
        deadline = time.monotonic() + 30  # until both have exec'd (their environments show)
        while len([m for m, p in procs.items() if p.pid in _reaper.marked(m)]) < 2:
            assert time.monotonic() < deadline, "the marked processes did not start"
            time.sleep(0.02)
        _reaper.sweep_abandoned()  # (another launcher's reaper may sweep it first)
        assert procs[dead_job].wait(30) == -signal.SIGKILL
        assert procs[live_job].poll() is None, "a job whose launcher lives was swept"
    finally:
        for p in procs.values():
            p.kill()
            p.wait(30)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def describe(pids: list[int]) -> list[str]:
    """What each of ``pids`` is doing, for a failure's message."""
    said = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/wchan") as f:
                said.append(f"{pid}: state {state}, waiting in {f.read() or '-'}")
        except OSError:
            said.append(f"{pid}: gone")
    return said


@pytest.mark.procs
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_nothing_survives_a_launcher_stopped_by_a_signal(launch: Launch, tmp_path: Path,
                                                         reap_kids: None, sig: int) -> None:
    proc = launch("--nproc-per-node", "2", SCRIPTS / "spawn_helpers.py", tmp_path)
    pids = started(tmp_path, 2, proc)
    scratch = scratch_of(tmp_path)
    proc.send_signal(sig)
    res = finish(proc, 60)
    assert res.code == 128 + sig, res.err
    assert wait_dead(pids, 5) == [], "outlived the job"
    assert not scratch.exists() and job_cgroups(proc.pid) == []


@pytest.mark.procs
def test_what_a_worker_leaves_behind_ends_with_it(launch: Launch, tmp_path: Path,
                                                  reap_kids: None) -> None:
    proc = launch("--nproc-per-node", "2", SCRIPTS / "spawn_helpers.py", tmp_path, "exit")
    res = finish(proc, 60)
    assert res.code == 0, res.err
    assert wait_dead(kids(tmp_path), 5) == []


@pytest.mark.procs
def test_the_launcher_says_how_its_workers_are_contained(launch: Launch, tmp_path: Path,
                                                         reap_kids: None) -> None:
    res = finish(launch("--nproc-per-node", "1", SCRIPTS / "spawn_helpers.py", tmp_path,
                        "exit"), 60)
    assert res.code == 0, res.err
    here = containment.Containment.create()  # what the launcher found, in the same place
    has_cgroup, reason = bool(here.cgroup), here.reason
    here.close()
    if has_cgroup:
        assert "workers are contained by the cgroup" in res.err, res.err
    else:
        assert f"no cgroup: {reason}" in res.err, res.err


@pytest.mark.procs
def test_where_no_cgroup_can_be_made_the_launcher_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def unmounted() -> str:
        raise OSError("no cgroup v2 hierarchy is mounted")

    monkeypatch.setattr(containment, "_own_cgroup", unmounted)
    job = containment.Containment.create()
    assert job.cgroup == ""
    assert job.describe().endswith("no cgroup: no cgroup v2 hierarchy is mounted")
    assert "supervisor per worker" in job.describe()


@pytest.mark.procs
def test_without_a_cgroup_the_supervisor_alone_cleans_up(tmp_path: Path,
                                                         reap_kids: None) -> None:
    """A stand-in launcher starts one supervised worker without --cgroup, then dies."""
    env = {**os.environ, "RANK": "0", "TANDEM_ERROR_FILE": str(tmp_path / "e" / "error.json")}
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import os, subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, {BOOTSTRAP!r}, '--parent', str(os.getpid()), "
         f"'--forward', '15', {str(SCRIPTS / 'spawn_helpers.py')!r}, {str(tmp_path)!r}])\n"
         "time.sleep(120)\n"], env=env, start_new_session=True, text=True)
    try:
        pids = started(tmp_path, 1, launcher)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        assert wait_dead(pids, 15) == [], "outlived the launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.procs
def test_a_worker_killed_by_a_signal_is_reported_with_that_signal(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    res = subprocess.run([sys.executable, BOOTSTRAP, "--parent", str(os.getpid()), str(script)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGSEGV, res
    assert not list(Path(".").glob("core*"))


def run_with_a_readerless_stderr(code: str) -> subprocess.CompletedProcess[str]:
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-c", code], stderr=write,
                              stdout=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    finally:
        os.close(write)


@pytest.mark.procs
def test_a_supervisor_goes_on_after_a_write_to_its_dead_launcher() -> None:
    """A supervisor's stderr is a pipe to the launcher; once the launcher has died, a line
    it writes (about a process that would not die, say) must not stop its clean-up."""
    plain = run_with_a_readerless_stderr(
        "import sys; sys.stderr.write('x\\n'); sys.stderr.flush(); print('went on')")
    assert plain.returncode != 0 and plain.stdout == ""  # what such a write does
    said = run_with_a_readerless_stderr(
        "from tandem.run._supervisor import _say; _say('a'); _say('b'); print('went on')")
    assert said.returncode == 0 and said.stdout == "went on\n"
