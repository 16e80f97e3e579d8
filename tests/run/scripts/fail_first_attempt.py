"""Rank argv[1] fails while TORCHELASTIC_RESTART_COUNT is 0 (a torch script's resume check);
every rank logs its attempt in argv[2]."""
import os
import sys

rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
assert attempt == os.environ["TANDEM_RESTART_COUNT"], "the two spellings disagree"
with open(os.path.join(sys.argv[2], f"attempt{attempt}_rank{rank}"), "w") as f:
    f.write(os.environ["MASTER_PORT"])
if rank == sys.argv[1] and attempt == "0":
    raise RuntimeError("transient failure on the first attempt")
print(f"rank {rank} done on attempt {attempt}")
