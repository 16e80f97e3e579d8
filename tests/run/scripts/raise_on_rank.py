"""The rank given as argv[1] raises ValueError; the others wait to be stopped."""
import os
import sys
import time


def load_batch(rank: str) -> None:
    raise ValueError(f"bad batch on rank {rank}")


if os.environ["RANK"] == sys.argv[1]:
    time.sleep(0.2)
    load_batch(os.environ["RANK"])
time.sleep(60)
