"""Attempt 0: the rank given as argv[1] records the time and SIGKILLs itself.
Attempt 1: every rank records when it started and exits cleanly."""
import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[2])
rank, attempt = os.environ["RANK"], int(os.environ["TANDEM_RESTART_COUNT"])
if attempt == 0:
    if rank == sys.argv[1]:
        time.sleep(0.5)
        (out / "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
else:
    (out / f"restarted_{rank}").write_text(repr(time.time()))
