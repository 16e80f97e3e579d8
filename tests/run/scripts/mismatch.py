"""Rank 1 broadcasts while the others all-reduce: a collective mismatch on every rank."""
import torch

import tandem as dist

dist.init_process_group()
t = torch.ones(4)
if dist.get_rank() == 1:
    dist.broadcast(t, src=0)
else:
    dist.all_reduce(t)
dist.destroy_process_group()
