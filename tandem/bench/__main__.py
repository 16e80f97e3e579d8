"""``python -m tandem.bench <command> [options]``: dispatch to one benchmark module.

``python -m tandem.bench --help`` lists the commands; ``python -m tandem.bench
collectives --help`` shows one command's options. A new benchmark is a module with
``main(argv: list[str]) -> int`` and one line in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from types import FrameType
from typing import Sequence

# name -> module exposing main(argv); imported lazily so one command's imports
# (and failures) never slow down or break another
COMMANDS: dict[str, str] = {
    "collectives": "tandem.bench.collectives",
    "ddp": "tandem.bench.ddp",
    "recorder": "tandem.bench.recorder",
    "recovery": "tandem.bench.recovery",
    "rpc": "tandem.bench.rpc",
    "zero": "tandem.bench.zero",
    "latency": "tandem.bench.latency",
    "signature": "tandem.bench.signature",
    "scale": "tandem.bench.scale",
    "slow-links": "tandem.bench.slow_links",
    "startup": "tandem.bench.startup",
    "store": "tandem.bench.store",
    "torch-backend": "tandem.bench.torch_backend",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m tandem.bench",
        description="Measure tandem and its torch equivalent side by side.",
        epilog="Run 'python -m tandem.bench COMMAND --help' for a command's options.")
    parser.add_argument("command", choices=sorted(COMMANDS))
    # only the command name is parsed here; the rest belongs to the command
    ns = parser.parse_args(args[:1])
    module = importlib.import_module(COMMANDS[ns.command])
    return int(module.main(args[1:]))


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    # a benchmark stopped with SIGTERM or SIGHUP (a timeout, a closed terminal) unwinds
    # like one interrupted with Ctrl-C: its simulated hosts' namespaces, delay processes
    # and ranks are removed by their context managers instead of being left running
    for _sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _exit)
    sys.exit(main())
