"""Rank 0 raises, then takes a second in its finally block after leaving the group: the
other rank fails at once, of the consequence (it lost its peer)."""
import os
import time

import torch

import tandem as dist

dist.init_process_group()
t = torch.ones(4)
dist.all_reduce(t)
try:
    if os.environ["RANK"] == "0":
        raise ValueError("the real cause, on rank 0")
    dist.all_reduce(t)
finally:
    dist.destroy_process_group()
    if os.environ["RANK"] == "0":
        time.sleep(1.0)
