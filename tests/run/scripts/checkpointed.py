"""Train a tiny 'model' with tandem for argv[2] steps, checkpointing to argv[1] every step.

On the first attempt rank 1 crashes at step 3; a restarted job resumes from the
checkpoint, so the final weights equal those of a run without the crash.
"""
import os
import sys

import torch

import tandem as dist

ckpt, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
w, start = torch.zeros(4), 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    w, start = state["w"], state["step"]
    print(f"rank {rank} resumed at step {start}", flush=True)
for step in range(start, steps):
    if rank == 1 and step == 3 and os.environ["TANDEM_RESTART_COUNT"] == "0":
        raise RuntimeError("crash at step 3")
    grad = torch.full((4,), float(rank + 1 + step))
    dist.all_reduce(grad)
    w -= 0.1 * grad / world
    dist.barrier()  # every rank finished the step before it is checkpointed
    if rank == 0:
        torch.save({"w": w, "step": step + 1}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
print(f"rank {rank} final {w[0].item():.4f}", flush=True)
dist.destroy_process_group()
