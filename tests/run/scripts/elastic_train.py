"""An elastic training job for the launcher tests (the model and data of
tests/elastic/_elastic_job.py), run by tandemrun on every worker.

    elastic_train.py OUT STEPS [--kill RANK:STEP]... [--wait-full STEP]... [--sleep S]
                     [--die-slot SLOT] [--min-ranks N] [--full N] [--wait-spare STEP]
                     [--kill-where backward|allreduce|optimizer] [--wait-exit STEP:NAME]

Each worker writes OUT/pid_<pid> and OUT/name_<name> (holding its pid) when it starts
(<name>: its TANDEM_ELASTIC_ID), OUT/warm_<name> (holding its parent's pid, the
supervisor's) when it was forked warm (torch already imported), and, at
the end, OUT/result_<name>.pt (parameters, the steps applied as (step, world size,
sample position), its final rank and pid). ``--kill`` makes the worker that started
as RANK SIGKILL itself at that step (repeatable), in backward or ``--kill-where``
(``_elastic_job.arm_kill``); ``--wait-full`` holds the
training at that step (committing) until the job is back to ``--full`` ranks
(repeatable); ``--die-slot``
makes every replacement started for that slot fail at once; ``--wait-spare`` holds
every worker at that step until a joiner waits in the queue; ``--wait-exit`` holds
every worker at STEP until the launcher has recorded the exit of worker NAME in the
roster (which it does after saying what it does about that death); ``--kill-zygote``
makes the worker that will kill itself SIGKILL the launcher's zygote a step before;
``--stop RANK:STEP`` makes the worker that started as RANK SIGSTOP itself at that step.
"""
import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

STARTED_WARM = "torch" in sys.modules  # forked from the launcher's zygote (tandem.run.warm)

import torch  # noqa: E402
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "elastic"))

import tandem  # noqa: E402
from tandem.config import load_settings  # noqa: E402
from tandem.elastic import ElasticSampler, ElasticState, run_elastic  # noqa: E402
from tandem.elastic._regroup import open_elastic_store  # noqa: E402
from tandem.elastic.roster import Roster  # noqa: E402
from tandem.parallel import DistributedDataParallel  # noqa: E402
from tandem.parallel.comm_hooks import allreduce_hook  # noqa: E402

from _elastic_job import (BATCH, N, SEED, arm_kill, data, killing_hook, model,  # noqa: E402
                          optimizer)

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("steps", type=int)
p.add_argument("--kill", action="append", default=[])
p.add_argument("--wait-full", type=int, action="append", default=[])
p.add_argument("--full", type=int, default=0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--die-slot", type=int, default=-1)
p.add_argument("--min-ranks", type=int, default=1)
p.add_argument("--wait-spare", type=int, default=-1)
p.add_argument("--wait-exit", default="")
p.add_argument("--kill-zygote", action="store_true")
p.add_argument("--stop", default="")
p.add_argument("--kill-where", choices=["backward", "allreduce", "optimizer"],
               default="backward")
ns = p.parse_args()

out = Path(ns.out)
name = os.environ["TANDEM_ELASTIC_ID"]
slot = int(name.split(".")[1][1:])
joiner = os.environ.get("TANDEM_ELASTIC_JOIN") == "1"
for note in (f"pid_{os.getpid()}", f"name_{name}"):  # pid_*: the test kit kills leftovers
    (out / f".{note}").write_text(str(os.getpid()))
    os.replace(out / f".{note}", out / note)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _kill_zygote() -> None:
    """SIGKILL the launcher's zygote (a child of the launcher running _zygote.py), once
    it is there."""
    launcher = _parent(os.getppid())  # our supervisor's parent
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                found = b"_zygote.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if found and _parent(pid) == launcher:
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.05)


for note in [f"warm_{name}"] if STARTED_WARM else []:  # our supervisor, and its parent
    (out / f".{note}").write_text(f"{os.getppid()} {_parent(os.getppid())}")
    os.replace(out / f".{note}", out / note)
if joiner and slot == ns.die_slot:
    raise RuntimeError(f"worker {name} fails at start, as told")

torch.set_num_threads(1)
tandem.init_process_group()
x, y = data()
net = model()
ddp = DistributedDataParallel(net)
opt = optimizer(net)
state = ElasticState(model=ddp, optimizer=opt, step=0, history=[], min_ranks=ns.min_ranks)
sampler = ElasticSampler(N, state, BATCH, seed=SEED)
kills = {int(r): int(s) for r, s in (k.split(":") for k in ns.kill)}
victim = not joiner and int(os.environ["RANK"]) in kills
if ns.kill_where == "allreduce":  # every rank the same hook; the victim's kills
    ddp.register_comm_hook(None, killing_hook if victim else allreduce_hook)
stop_rank, _, stop_step = ns.stop.partition(":")
stopper = bool(ns.stop) and not joiner and os.environ["RANK"] == stop_rank
if victim:
    arm_kill(kills[int(os.environ["RANK"])], ns.kill_where, net, opt, state)


def _await(seen: Callable[[Roster], object], seconds: float = 60) -> None:
    """Until ``seen(roster)`` holds (or ``seconds`` pass: the test's checks then fail)."""
    store, prefix = open_elastic_store(os.environ["TANDEM_ELASTIC_STORE"], load_settings())
    roster = Roster(store, prefix)
    deadline = time.monotonic() + seconds
    while not seen(roster) and time.monotonic() < deadline:
        time.sleep(0.05)
    store.close()


wait_exit_step, _, wait_exit_name = ns.wait_exit.partition(":")


@run_elastic(state)
def train(state: ElasticState) -> None:
    for idx in sampler:
        if state.step >= ns.steps:
            return
        if victim and ns.kill_zygote and state.step == kills[int(os.environ["RANK"])] - 1:
            _kill_zygote()
        if stopper and state.step == int(stop_step):  # stuck for good, as a SIGSTOP leaves it
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.history.append((state.step, state.world_size, sampler.position_at(state.step)))
        state.step += 1
        time.sleep(ns.sleep)
        if state.step == ns.wait_spare:  # a spare that will take a lost worker's place
            _await(Roster.joiners)
        if wait_exit_name and state.step == int(wait_exit_step):
            # as long as the first replacement may wait for the zygote still importing (20 s
            # at a load of 20 on 2 cores), and then for the replacements after it
            _await(lambda roster: wait_exit_name in roster.exited(), 120)
        # a replacement may take a minute and more to join at a load of 20-30 on 2 cores
        deadline = time.monotonic() + 100
        while (state.step in ns.wait_full and state.world_size < ns.full
               and time.monotonic() < deadline):
            state.commit()  # where a waiting joiner is let in
            time.sleep(0.05)
        if state.step in ns.wait_full and state.world_size < ns.full:
            print(f"elastic_train: still {state.world_size} of {ns.full} ranks at step "
                  f"{state.step} after 100 s; going on", file=sys.stderr, flush=True)
        state.commit()


train()
torch.save({"params": [p.detach().clone() for p in net.parameters()],
            "history": list(state.history), "rank": tandem.get_rank(),
            "world_size": tandem.get_world_size(), "pid": os.getpid()},
           out / f"result_{name}.pt")
sys.stderr.write(f"finished as rank {tandem.get_rank()} of {tandem.get_world_size()}\n")
tandem.destroy_process_group()
