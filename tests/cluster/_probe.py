"""One rank under a scheduler: join with init_process_group() alone, all-reduce, report."""

import json
import os
import socket
import sys

import torch

import tandem
from tandem.collectives.cluster_env import cluster_env

torch.set_num_threads(1)
derived = cluster_env(os.environ)  # what init_process_group() reads, printed for the test
tandem.init_process_group()
t = torch.tensor([float(tandem.get_rank() + 1)])
tandem.all_reduce(t)
print(json.dumps({"rank": tandem.get_rank(), "world": tandem.get_world_size(), "sum": t.item(),
                  "host": socket.gethostname(),
                  **{k: derived.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                 "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                                 "MASTER_PORT")}}), flush=True)
tandem.destroy_process_group()
sys.exit(0)
