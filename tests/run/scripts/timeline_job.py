"""2 ranks under TANDEM_TIMELINE: a few all_reduce calls, then exit without destroying."""
import torch

import tandem as dist

dist.init_process_group()
for _ in range(3):
    dist.all_reduce(torch.ones(256))
