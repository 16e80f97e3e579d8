"""Rank bodies of ``python -m tandem.bench scale --failures`` (and of tests/scale).

Each runs in a harness child (:func:`tandem.testing.launch`: torch preloaded, so 64
ranks start in seconds and share torch's pages), which first moves itself into its
simulated host's network namespace (:func:`enter_host`) and takes that host's identity,
then joins the group through a FileStore every namespace sees. The tandemrun scenario's
workers run this file as their script (:func:`worker_main`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from tandem.testing.logs import capture_stall_reports

__all__ = ["enter_host", "killed", "stalled", "skipped", "worker_main", "SKIP_LINE",
           "CALL_LINE"]

_CLONE_NEWNET = 0x40000000


def enter_host(names: Sequence[str], addrs: Sequence[str], rank: int, per_host: int) -> None:
    """Move this process into its host's namespace; set the host's identity for tandem."""
    if not names:
        return
    host = rank // per_host
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{names[host]}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {names[host]}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ.update({"TANDEM_HOST_ID": f"labhost{host}", "TANDEM_BIND_ADDR": addrs[host]})


def _join(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
          per_host: int, timeout: float) -> None:
    import tandem

    enter_host(names, addrs, rank, per_host)
    tandem.init_process_group("auto", init_method=f"file://{store}", rank=rank,
                              world_size=world, timeout=timeout)


def killed(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
           per_host: int, victim: int, stamp: str, timeout: float) -> dict[str, Any]:
    """``victim`` SIGKILLs itself while everyone loops on all_reduce; the others return
    the error they got and when (wall clock; the victim wrote its time to ``stamp``)."""
    import torch

    import tandem

    _join(rank, world, store, names, addrs, per_host, timeout)
    t = torch.ones(1 << 10)
    try:  # a slow rank may still be in the first call when the news comes
        tandem.all_reduce(t)
        if rank == victim:
            def die() -> None:
                Path(stamp).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Timer(0.5, die).start()
        for _ in range(10_000_000):
            tandem.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 - described for the caller
        return {"type": type(exc).__name__, "msg": str(exc), "at": time.time()}
    return {"type": "none", "msg": "", "at": time.time()}


def stalled(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
            per_host: int, victim: int, timeout: float) -> list[tuple[float, str]]:
    """``victim`` stops itself (SIGSTOP) before an all_reduce; the others return the stall
    reports they logged while waiting for it: (seconds into the call, text)."""
    import torch

    import tandem

    reports = capture_stall_reports()
    _join(rank, world, store, names, addrs, per_host, timeout)
    tandem.all_reduce(torch.ones(4))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        tandem.all_reduce(torch.ones(4))
    except Exception:  # noqa: BLE001 - the call times out; the reports are the result
        pass
    return reports.since(start)


def _line_of(marker: str) -> int:
    """The line of this file that carries ``marker`` in a comment (the sites the caller
    expects an error to name)."""
    for number, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# {marker}"):
            return number
    raise LookupError(marker)


def skipped(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
            per_host: int, victim: int, timeout: float) -> dict[str, Any]:
    """Every rank calls all_reduce then barrier, but ``victim`` skips the all_reduce: its
    barrier meets the others' all_reduce. Each returns the error it got and how long the
    call took to fail."""
    import torch

    import tandem

    _join(rank, world, store, names, addrs, per_host, timeout)
    t = torch.ones(1 << 10)
    start = time.monotonic()
    try:  # a slow rank may still be in the first call when the others' error comes
        tandem.all_reduce(t)
        if rank != victim:
            tandem.all_reduce(t)  # scale-call
        tandem.barrier()  # scale-skip
        tandem.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 - described for the caller
        return {"type": type(exc).__name__, "msg": str(exc), "took": time.monotonic() - start}
    return {"type": "none", "msg": "", "took": time.monotonic() - start}


SKIP_LINE = _line_of("scale-skip")
CALL_LINE = _line_of("scale-call")


def worker_main(argv: Sequence[str]) -> int:
    """A tandemrun worker: all_reduce in a loop; rank ``victim`` raises at step 3.

    argv: VICTIM STEPS. Rank, world and the store come from tandemrun's environment.
    """
    import torch

    import tandem

    victim, steps = int(argv[0]), int(argv[1])
    torch.set_num_threads(1)
    tandem.init_process_group("auto")
    rank = tandem.get_rank()
    t = torch.ones(1 << 10)
    for step in range(steps):
        if rank == victim and step == 3:
            raise RuntimeError(f"rank {rank} failed on purpose at step {step}")
        tandem.all_reduce(t)
    tandem.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
