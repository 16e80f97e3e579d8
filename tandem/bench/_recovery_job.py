"""The worker of ``python -m tandem.bench recovery``: the main example, with a step log.

Run by tandemrun in place of ``examples/train_chars.py`` (same arguments). Before the
example starts it registers a global optimizer step hook that appends one line per
completed step to ``$TANDEM_BENCH_STEPS/<rank>.<pid>``::

    <wall time> <optimizer step count> <world size> <group>

The step count is AdamW's own (restored from a checkpoint or a rollback, so it is the
training step); ``group`` numbers the process groups this process has trained in (it
changes when an elastic job re-forms its group). A worker that joins an elastic job
(a spare) touches ``$TANDEM_BENCH_QUEUED/<pid>`` once it waits in the join queue, so
the bench kills only when a spare is ready. The example itself carries no bench code.
"""

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_chars.py"
_worlds: list[Any] = []  # kept alive, so that a new group never reuses an old one's id


def _log_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    from tandem.collectives.world import world

    w = world()
    if not any(w is seen for seen in _worlds):
        _worlds.append(w)
    state: dict[str, Any] = next(iter(optimizer.state.values()), {})
    step = int(state.get("step", 0))
    group = next(i for i, seen in enumerate(_worlds) if seen is w)
    _out.write(f"{time.time():.6f} {step} {w.default.group_size} {group}\n")
    _out.flush()


if not EXAMPLE.exists():
    sys.exit(f"tandem.bench recovery: the main example is not at {EXAMPLE} (run the bench "
             f"from a tandem checkout)")
_out = open(os.path.join(os.environ["TANDEM_BENCH_STEPS"],  # noqa: SIM115 - open until exit
                         f"{os.environ['RANK']}.{os.getpid()}"), "a")
register_optimizer_step_post_hook(_log_step)
if os.environ.get("TANDEM_ELASTIC_JOIN") == "1":
    from tandem.elastic.roster import Roster

    enqueue = Roster.enqueue_joiner

    def _enqueue_and_tell(roster: Roster, worker: str) -> int:
        index = enqueue(roster, worker)
        Path(os.environ["TANDEM_BENCH_QUEUED"], str(os.getpid())).touch()
        return index

    Roster.enqueue_joiner = _enqueue_and_tell  # type: ignore[method-assign,assignment]
sys.path.insert(0, str(EXAMPLE.parent))
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
