"""2+ ranks: all_reduce over env:// and print the sum (and write it to $OUT_DIR/rank<r>.sum)."""
import os
import sys

import torch

import tandem as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
print(f"rank {rank} of {world}: sum {t[0].item():g}", flush=True)
if len(sys.argv) > 1:
    with open(os.path.join(sys.argv[1], f"rank{rank}.sum"), "w") as f:
        f.write(f"{t[0].item():g} {os.environ['MASTER_PORT']}")
dist.destroy_process_group()
