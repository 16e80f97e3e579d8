"""2 ranks: both all_reduce once; rank 1 then raises while rank 0 waits in user code.

Used to check that the launcher asks rank 0 for its flight recorder before it stops it.
"""
import time

import torch

import tandem as dist

dist.init_process_group()
dist.all_reduce(torch.ones(4))
if dist.get_rank() == 1:
    time.sleep(0.5)
    raise ValueError("bad batch")
while True:
    time.sleep(0.05)  # rank-0-waits
