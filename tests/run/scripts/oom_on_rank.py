"""Rank 1 joins the memory cgroup named by OOM_CGROUP (a small limit) and allocates until
the kernel's OOM killer kills it; rank 0 waits. Nothing else on the machine is touched."""
import os
import sys
import time

if os.environ["RANK"] == "1":
    cgroup = os.environ["OOM_CGROUP"]
    procs = os.path.join(cgroup, "cgroup.procs")
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
    if os.path.basename(cgroup) not in open("/proc/self/cgroup").read():
        sys.exit("could not join the test's memory cgroup; not allocating")
    hoard = []
    for _ in range(4096):  # at most 4 GiB; the cgroup's limit ends it long before
        hoard.append(b"x" * (1 << 20))
    sys.exit("the memory cgroup's limit did not stop the allocation")
while True:
    time.sleep(0.05)
