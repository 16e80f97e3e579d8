"""Run the main job, examples/train_chars.py, with the arguments after argv[2].

On the first attempt (TANDEM_RESTART_COUNT == 0) the rank argv[1] SIGKILLs itself just
before its optimizer step number argv[2] (0: never), through torch's global optimizer
step hook, so the example itself carries no test code. Each worker writes its pid to
attempt_<n>/pid_<rank> under the current directory (the test's temporary directory).
"""
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
kill_rank, kill_step, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rank, attempt = os.environ["RANK"], os.environ["TANDEM_RESTART_COUNT"]

pid_dir = Path(f"attempt_{attempt}")
pid_dir.mkdir(exist_ok=True)
(pid_dir / f".pid_{rank}").write_text(str(os.getpid()))
os.replace(pid_dir / f".pid_{rank}", pid_dir / f"pid_{rank}")

if rank == kill_rank and attempt == "0" and kill_step > 0:
    steps = 0

    def kill_before_step(optimizer: Optimizer, a: Any, kw: Any) -> None:
        global steps
        steps += 1
        if steps == kill_step:
            print(f"rank {rank}: SIGKILL before optimizer step {steps}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_pre_hook(kill_before_step)

sys.path.insert(0, str(EXAMPLES))
sys.argv = [str(EXAMPLES / "train_chars.py"), *args]
runpy.run_path(sys.argv[0], run_name="__main__")
