"""Write what a worker sees of its process to OUT/facts_<RANK>.json: warm workers (forked
from the launcher's zygote) and cold ones (new interpreters) must see the same.

    worker_facts.py OUT [ARGS...]

With ``FACTS_FAIL_RANK`` set, that rank raises after writing its facts on the first attempt.
"""
import os
import signal
import sys

STARTED_WARM = "torch" in sys.modules  # forked from the launcher's zygote (tandem.run.warm)

import json  # noqa: E402
import random  # noqa: E402
import stat  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402


def _fd_kinds() -> dict:
    """Each open descriptor: what kind of file it is (the listing's own left out)."""
    kinds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            mode = os.fstat(int(name)).st_mode
        except OSError:
            continue  # the listing's own descriptor, closed by now
        kinds[name] = ("pipe" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode)
                       else "chr" if stat.S_ISCHR(mode) else "file")
    return kinds


def _handler(sig: int) -> str:
    h = signal.getsignal(sig)
    return h.__name__ if callable(h) else str(h)


facts = {
    "warm": STARTED_WARM,
    "env": dict(os.environ),
    "argv": sys.argv,
    "name": __name__,
    "main_file": sys.modules["__main__"].__file__,
    "cwd": os.getcwd(),
    "sys_path": sys.path,
    "executable": sys.executable,
    "flags": list(sys.flags),
    "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
    "os_threads": len(os.listdir("/proc/self/task")),
    "torch_seed": torch.initial_seed(),
    "torch_rand": torch.rand(2).tolist(),
    "random": random.random(),
    "numpy": float(numpy.random.rand()),
    "own_group": os.getpgid(0) == os.getpid(),
    "session_is_parent": os.getsid(0) == os.getppid(),
    "signals": {s.name: _handler(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                                signal.SIGUSR1, signal.SIGCHLD, signal.SIGHUP)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "fds": _fd_kinds(),
    "line_buffered": sys.stdout.line_buffering,
    "umask": os.umask(0o22),
}
rank, attempt = os.environ["RANK"], os.environ["TANDEM_RESTART_COUNT"]
out = os.path.join(sys.argv[1], f"facts_{rank}_{attempt}.json")
with open(out + ".tmp", "w") as f:
    json.dump(facts, f)
os.replace(out + ".tmp", out)
print(f"rank {rank} says hello")
if os.environ.get("FACTS_FAIL_RANK") == rank and attempt == "0":
    raise RuntimeError(f"rank {rank} fails its first attempt, as told")
