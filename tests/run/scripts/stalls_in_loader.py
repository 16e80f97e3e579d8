"""3 ranks: rank 2 hangs in its data loader (a sleep), the others time out waiting for it."""
import datetime
import time

import torch

import tandem as dist

dist.init_process_group(timeout=datetime.timedelta(seconds=4))
dist.all_reduce(torch.ones(4))
if dist.get_rank() == 2:
    while True:
        time.sleep(0.05)  # a data loader that never returns
dist.all_reduce(torch.ones(4))
