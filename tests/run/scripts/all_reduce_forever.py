"""Join the job, write pid to <argv[1]>/pid_<RANK>, then all-reduce until stopped."""
import os
import sys
import time

import torch

import tandem as dist

dist.init_process_group()
out, rank = sys.argv[1], os.environ["RANK"]
with open(os.path.join(out, f"pid_{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid_{rank}.tmp"), os.path.join(out, f"pid_{rank}"))
t = torch.ones(1024)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    dist.all_reduce(t)
    time.sleep(0.002)
