"""Run with -m: prints its rank, __name__ and args."""
import os
import sys

print(f"module rank {os.environ['RANK']} name {__name__} args {sys.argv[1:]}")
