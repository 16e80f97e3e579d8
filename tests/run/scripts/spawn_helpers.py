"""Start helpers the way real jobs do, then wait (or, with argv[2] == "exit", leave).

Writes <dir>/pid_<RANK> (this worker), <dir>/kid_<RANK>_<name> for each helper:
``plain`` (a child in our process group), ``session`` (a child that starts its own
session), ``daemon`` (double-forked: its parent exits, it is orphaned at once), and
<dir>/scratch_<RANK>: the directory of this worker's error file.
"""
import os
import subprocess
import sys
import time

out, rank = sys.argv[1], os.environ["RANK"]
mode = sys.argv[2] if len(sys.argv) > 2 else ""
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def note(name, value):
    tmp = os.path.join(out, f"{name}.tmp")
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, os.path.join(out, name))


plain = subprocess.Popen(SLEEP)
session = subprocess.Popen(SLEEP, start_new_session=True)
r, w = os.pipe()
middle = os.fork()
if middle == 0:  # the classic daemon: fork, setsid, fork again, the middle one exits
    os.setsid()
    daemon = subprocess.Popen(SLEEP, pass_fds=())
    os.write(w, str(daemon.pid).encode())
    os._exit(0)
os.waitpid(middle, 0)
os.close(w)
daemon_pid = int(os.read(r, 32))
note(f"kid_{rank}_plain", plain.pid)
note(f"kid_{rank}_session", session.pid)
note(f"kid_{rank}_daemon", daemon_pid)
note(f"scratch_{rank}", os.path.dirname(os.environ["TANDEM_ERROR_FILE"]))
note(f"pid_{rank}", os.getpid())
if mode == "exit":
    sys.exit(0)
time.sleep(120)
sys.exit(3)
