"""An argparse script: ``--help`` and a bad flag print the same text on every rank."""
import argparse

p = argparse.ArgumentParser(description="a job with flags")
p.add_argument("--steps", type=int, default=3, help="how many steps")
p.add_argument("--lr", type=float, default=0.1, help="the learning rate")
p.parse_args()
