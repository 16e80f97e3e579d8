"""Write pid to <dir>/pid_<RANK>; on SIGTERM/SIGINT/SIGUSR1 write <dir>/got_<SIG>_<RANK>.

SIGTERM and SIGINT end the worker; SIGUSR1 ends it successfully. With argv[2] ==
"ignore", SIGTERM is ignored (the launcher must SIGKILL it).
"""
import os
import signal
import sys
import time

out, rank = sys.argv[1], os.environ["RANK"]
mode = sys.argv[2] if len(sys.argv) > 2 else ""


def note(signum, frame):
    name = signal.Signals(signum).name
    open(os.path.join(out, f"got_{name}_{rank}"), "w").close()
    if signum == signal.SIGUSR1:
        sys.exit(0)
    if mode != "ignore":
        sys.exit(128 + signum)


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(s, note)
with open(os.path.join(out, f"pid_{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid_{rank}.tmp"), os.path.join(out, f"pid_{rank}"))
deadline = time.time() + 60
while time.time() < deadline:
    time.sleep(0.05)
sys.exit(3)
