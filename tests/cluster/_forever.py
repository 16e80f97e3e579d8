"""A rank that trains forever (an all-reduce every 50 ms) until it is stopped."""

import time

import torch

import tandem

torch.set_num_threads(1)
tandem.init_process_group()
t = torch.ones(1)
tandem.all_reduce(t)
print(f"running {tandem.get_rank()}", flush=True)
while True:
    tandem.all_reduce(t)
    time.sleep(0.05)
