"""Rank 0 raises first but takes 1.5 s to exit (an exit handler); rank 1 raises its own
error 0.3 s later and exits at once."""
import atexit
import os
import time

if os.environ["RANK"] == "0":
    atexit.register(time.sleep, 1.5)
    raise ValueError("first, on rank 0")
time.sleep(0.3)
raise KeyError("second, on rank 1")
