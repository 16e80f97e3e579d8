"""2 ranks: each dumps its flight recorder (tandem.dump_flight_recorder), says so in a
``pid_<rank>`` file (its pid), then waits in user code until the launcher stops it."""
import os
import time
from pathlib import Path

import torch

import tandem as dist

dist.init_process_group()
dist.all_reduce(torch.ones(4))
dist.dump_flight_recorder()
Path(f"pid_{dist.get_rank()}.tmp").write_text(str(os.getpid()))
os.replace(f"pid_{dist.get_rank()}.tmp", f"pid_{dist.get_rank()}")  # whole, for the test
while True:
    time.sleep(0.05)
