"""Record (WORLD_SIZE, restart) per rank in argv[1]; exit 0 once WORLD_SIZE == argv[2]
(and, if argv[4] is given, TANDEM_RESTART_COUNT >= argv[4]).

Until then: mode "sleep" waits (to be stopped by the launcher); mode "tandem" joins the
process group and runs barriers, so a lost node makes it fail with PeerLostError.
"""
import os
import sys
import time

out, target, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank, ws = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
restart = os.environ["TANDEM_RESTART_COUNT"]
open(os.path.join(out, f"seen_ws{ws}_rank{rank}_restart{restart}"), "w").close()
with open(os.path.join(out, f"tmp_{os.getpid()}"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"tmp_{os.getpid()}"),
           os.path.join(out, f"pid_{os.getpid()}"))
if ws == target and int(restart) >= int(sys.argv[4] if len(sys.argv) > 4 else 0):
    sys.exit(0)
deadline = time.time() + 120
if mode == "tandem":
    import tandem as dist

    dist.init_process_group()
    while time.time() < deadline:
        dist.barrier()
        time.sleep(0.1)
while time.time() < deadline:
    time.sleep(0.1)
sys.exit(3)
