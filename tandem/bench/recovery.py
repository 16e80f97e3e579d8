"""Time lost to one SIGKILLed rank: in-place recovery against restarting from a checkpoint.

Run::

    python -m tandem.bench recovery                          # 2 and 4 ranks, 3 repeats
    python -m tandem.bench recovery --world-sizes 2 --repeats 5 --markdown
    python -m tandem.bench recovery --quick                  # 2 ranks, one repeat
    python -m tandem.bench recovery --hosts 2                # 2 simulated hosts (root)

How it measures. Each run launches the main example (``examples/train_chars.py``,
``--quick`` model and data) with tandemrun and, once every rank has trained
``--warmup`` steps, SIGKILLs the worker that started as rank 1, from outside, at
whatever point of its step it is. Every worker logs each completed optimizer step
(wall time, step count, world size, process group: ``_recovery_job.py``). From the
kill, the columns give

    resume  the first step completed by a re-formed group (or a restarted job)
    full    the first step completed at full size again: the time lost, as issue 15
            defines it
    redone  steps trained again (from the commit or checkpoint back to the step killed)
    work    an estimate of the training time really lost: ``full`` plus the redone
            steps, less the progress made meanwhile at a smaller size (the steps of a
            smaller group count for their share of the full batch), both at the
            full-size step time measured before the kill

for three ways to take the kill, rotated within each repeat so all see the same noise:

    restart   tandemrun --max-restarts: every worker stops, all restart and resume from
              the example's last checkpoint (``--save-every``, default 20 steps)
    in-place  ``--elastic``: the survivors go on without the lost rank; the launcher
              forks a replacement from its zygote (``tandem.run.warm``: torch and tandem
              imported), which joins at a commit; the kill waits until the zygote is
              ready (the launcher says so), as a job's failures come after its start
    cold      the same with ``--no-warm-start``: the replacement is a new interpreter
    spare     ``--elastic`` with ``--spares 1``: a worker already waits to join and takes
              the lost place in the survivors' own round

ratio = in-place time lost / restart time lost (the target is at most 0.25). The table
shows the median over ``--repeats`` and the range.

``--hosts 2`` runs each job on 2 simulated hosts: network namespaces on a private bridge
(``tandem.testing.netns``, which needs root), one tandemrun agent per host with half the
ranks, the store on the first host's address, tcp between hosts (links not shaped).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from tandem.testing.netns import NetnsLab, netns_lab

__all__ = ["main", "measure", "Lost"]

JOB = Path(__file__).with_name("_recovery_job.py")
LAB_PORT = "29500"  # the store's port on the first simulated host (a private namespace)
MODES = ("restart", "in-place", "cold", "spare")
EXAMPLE_ARGS = ("--quick", "--steps", "100000", "--corpus-mb", "0.3")
WAIT = 120.0  # seconds a run may take to reach each point


@dataclasses.dataclass(frozen=True)
class Lost:
    resume: float  # seconds from the kill
    full: float
    redone: int
    work: float  # seconds of full-size training lost (see the module docstring)


@dataclasses.dataclass(frozen=True)
class Step:
    time: float
    step: int
    world: int
    member: tuple[int, int]  # (pid, process group): who trained it, in which group


def _read(directory: Path) -> dict[str, list[Step]]:
    """Each worker's steps, by file name (``<rank>.<pid>``)."""
    out = {}
    for path in directory.iterdir():
        rows = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:  # a line being written is skipped until complete
                pid = int(path.name.split(".")[1])
                rows.append(Step(float(parts[0]), int(parts[1]), int(parts[2]),
                                 (pid, int(parts[3]))))
        out[path.name] = rows
    return out


def _command(mode: str, ranks: int, out: Path, lab: NetnsLab | None, node: int) -> list[str]:
    """The launcher's command line (on simulated host ``node`` of ``lab``, if any)."""
    if lab is None:
        launcher = ["--standalone", "--nproc-per-node", str(ranks)]
        prefix: list[str] = []
    else:
        hosts = len(lab.names)
        launcher = ["--nnodes", str(hosts), "--nproc-per-node", str(ranks // hosts),
                    "--node-rank", str(node), "--master-addr", lab.addrs[0],
                    "--master-port", LAB_PORT]
        prefix = ["ip", "netns", "exec", lab.names[node]]
    launcher += ["--max-restarts", "3"]
    if mode == "spare":
        launcher += ["--spares", "1"]
    if mode == "cold":
        launcher += ["--no-warm-start"]
    example = [*EXAMPLE_ARGS, "--out", str(out / "run")]
    example += ["--elastic"] if mode != "restart" else ["--save-every", "20"]
    return [*prefix, sys.executable, "-m", "tandem.run", *launcher, str(JOB), *example]


def _wait(what: str, procs: list[subprocess.Popen[bytes]], check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended:
            raise RuntimeError(f"the job ended (exit {ended[0]}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def _lab(hosts: int, workdir: Path) -> Iterator[NetnsLab | None]:
    """``hosts`` simulated hosts (None for 1: this host)."""
    if hosts == 1:
        yield None
        return
    with netns_lab(hosts, workdir) as lab:  # Unavailable(reason) without root
        yield lab


def measure(mode: str, ranks: int, warmup: int, hosts: int = 1) -> Lost:
    """One run: launch, warm up, SIGKILL rank 1's worker, time the recovery."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-recovery-") as tmp:
        steps, queued = Path(tmp) / "steps", Path(tmp) / "queued"
        steps.mkdir()
        queued.mkdir()
        # OMP_NUM_THREADS=1 for one worker per host too (tandemrun sets it for more): each
        # rank trains on one thread anyway, and numpy's BLAS then starts no thread pool
        # at import, which would keep the launcher's zygote from forking warm workers
        env = {**os.environ, "TANDEM_BENCH_STEPS": str(steps), "TANDEM_BENCH_QUEUED": str(queued),
               "PYTHONUNBUFFERED": "1", "TANDEM_TRACE_DIR": str(Path(tmp) / "trace"),
               "OMP_NUM_THREADS": "1"}
        if hosts > 1:  # the agents of a multi-node job share a secret
            env["TANDEM_SECRET"] = os.urandom(16).hex()
        job_logs = [Path(tmp) / f"job{node}.log" for node in range(hosts)]
        with _lab(hosts, Path(tmp) / "lab") as lab, contextlib.ExitStack() as jobs:
            procs = [jobs.enter_context(_job(
                _command(mode, ranks, Path(tmp), lab, node),
                {**env, "TANDEM_HOST_ID": f"nshost{node}"} if lab else env,
                job_logs[node])) for node in range(hosts)]

            def warm() -> bool:
                logs = _read(steps)
                done = [rows[-1].step for rows in logs.values() if rows]
                return len(done) >= ranks and min(done) >= warmup

            _wait(f"{warmup} warm-up steps", procs, warm)
            if mode == "in-place":
                _wait("the launchers' zygotes", procs, lambda: all(
                    "warm starts ready" in text or "warm starts off" in text
                    for text in (log.read_text(errors="replace") for log in job_logs)))
            if mode == "spare":
                _wait("the spare to wait in the join queue", procs,
                      lambda: any(queued.iterdir()))
            victim = min((name for name in _read(steps) if name.startswith("1.")),
                         key=lambda n: int(n.split(".")[1]))
            killed = time.time()
            os.kill(int(victim.split(".")[1]), signal.SIGKILL)
            seen = {s.member for rows in _read(steps).values() for s in rows}

            def new(s: Step) -> bool:
                return s.time > killed and s.member not in seen

            _wait("a full-size step after the kill", procs,
                  lambda: any(new(s) and s.world == ranks
                              for rows in _read(steps).values() for s in rows))
        logs = _read(steps)
    before = max(s.step for rows in logs.values() for s in rows if s.time <= killed)
    after = sorted((s for rows in logs.values() for s in rows if new(s)), key=lambda s: s.time)
    full = next(s for s in after if s.world == ranks)
    redone = max(0, before - after[0].step + 1)
    # each worker logs each step of its group: a row is 1/ranks of a full-size step
    meanwhile = sum(1 for s in after if s.time < full.time and s.step > before) / ranks
    work = full.time - killed + (redone - meanwhile) * _step_time(logs, killed, ranks)
    return Lost(resume=after[0].time - killed, full=full.time - killed, redone=redone,
                work=max(0.0, work))


def _step_time(logs: dict[str, list[Step]], killed: float, ranks: int) -> float:
    """The median full-size step time of the last 20 steps before the kill."""
    for rows in logs.values():
        times = [s.time for s in rows if s.time <= killed and s.world == ranks][-21:]
        if len(times) >= 2:
            return statistics.median(b - a for a, b in zip(times, times[1:]))
    return 0.0


@contextlib.contextmanager
def _job(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The launcher, stopped (SIGTERM, then SIGKILL) however the run ends."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            yield proc
        except BaseException:
            sys.stderr.write(log.read_text(errors="replace")[-3000:])
            raise
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)


def _fmt(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def table(results: dict[tuple[int, str], list[Lost]], markdown: bool) -> str:
    """Medians (and ranges) per (ranks, mode); ratio against restart's time lost."""
    rows = [("ranks", "mode", "resume", "time lost (full size)", "ratio", "redone steps",
             "work lost")]
    for (ranks, mode), runs in sorted(results.items(), key=lambda kv: (kv[0][0],
                                                                       MODES.index(kv[0][1]))):
        base = results.get((ranks, "restart"))
        ratio = ""
        if base and mode != "restart":
            ratio = f"{statistics.median(r.full for r in runs) / statistics.median(r.full for r in base):.2f}"
        rows.append((str(ranks), mode, _fmt([r.resume for r in runs]),
                     _fmt([r.full for r in runs]), ratio,
                     f"{statistics.median(r.redone for r in runs):.0f}",
                     _fmt([r.work for r in runs])))
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench recovery",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--world-sizes", default="2,4", help="ranks per run (default 2,4)")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode and size (3)")
    p.add_argument("--warmup", type=int, default=30, help="steps before the kill (30)")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {','.join(MODES)}")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--quick", action="store_true", help="2 ranks, one repeat")
    p.add_argument("--hosts", type=int, default=1,
                   help="simulated hosts (network namespaces, root; default 1: this host)")
    ns = p.parse_args(argv)
    sizes = [2] if ns.quick else [int(s) for s in ns.world_sizes.split(",") if s]
    repeats = 1 if ns.quick else ns.repeats
    modes = [m for m in ns.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or repeats < 1 or not sizes or min(sizes) < 2:
        p.error(f"modes must be among {MODES}, repeats >= 1, world sizes >= 2")
    if ns.hosts < 1 or any(s % ns.hosts for s in sizes):
        p.error(f"--hosts must be >= 1 and divide every world size ({sizes})")
    results: dict[tuple[int, str], list[Lost]] = {}
    for ranks in sizes:
        for r in range(repeats):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                lost = measure(mode, ranks, ns.warmup, ns.hosts)
                results.setdefault((ranks, mode), []).append(lost)
                where = f" on {ns.hosts} hosts" if ns.hosts > 1 else ""
                print(f"{ranks} ranks{where}, {mode}: resumed {lost.resume:.2f} s, full size "
                      f"{lost.full:.2f} s, {lost.redone} steps redone, work lost "
                      f"{lost.work:.2f} s", flush=True)
    print(table(results, ns.markdown))
    return 0
