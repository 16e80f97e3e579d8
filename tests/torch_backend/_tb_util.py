"""Helpers for the torch-backend tests (imported by the test modules and by their ranks).

Each rank process initialises torch.distributed itself (the harness runs with
``init=False``): ``file://`` rendezvous in the test's temporary directory, never a
fixed port. The oracle is torch's gloo on the same inputs, in the same process: a
gloo group over the same ranks (``new_group(backend="gloo")``) beside tandem's
default group, so both see identical data.
"""

from __future__ import annotations

import datetime
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from tandem.testing import Outcome, launch


def env() -> dict[str, str]:
    # gloo would otherwise pick the interface of the host name, which may not route
    if any(name == "lo" for _, name in socket.if_nameindex()):
        return {"GLOO_SOCKET_IFNAME": "lo"}
    return {}


def init(rank: int, world: int, store_dir: str, backend: str = "tandem",
         timeout: float = 60.0, store: str = "store", **kwargs: Any) -> None:
    """Join torch.distributed with ``backend`` (tandem's backend registered first);
    ``store`` names the rendezvous file in ``store_dir`` (a new one for each job)."""
    import tandem.torch_backend  # noqa: F401 - registers "tandem"

    dist.init_process_group(backend, init_method=f"file://{store_dir}/{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout),
                            **kwargs)


def run(world: int, fn: Callable[..., Any], store_dir: Any, *args: Any,
        timeout: float = 120.0) -> list[Outcome]:
    """Run ``fn(rank, world, store_dir, *args)`` on ``world`` ranks; outcomes per rank."""
    return launch(world, fn, (str(store_dir), *args), timeout=timeout, init=False, env=env())


def values(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's returned value; fail with the tracebacks of ranks that failed."""
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


def checked(cases: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each case, then leave torch.distributed; per case its result, or
    ``{"error": traceback}`` (one failure spoils no other)."""
    out: dict[str, Any] = {}
    try:
        for name, case in cases.items():
            try:
                out[name] = case()
            except Exception:  # noqa: BLE001 - reported per case to the test
                out[name] = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    return out


def results_on(world: int, fn: Callable[..., Any], tmp: Any, timeout: float,
               *args: Any) -> list[Any]:
    """Every rank's value of ``fn(rank, world, store_dir, *args)``; ``tmp`` is pytest's
    ``tmp_path_factory``."""
    return values(run(world, fn, tmp.mktemp("tb"), *args, timeout=timeout))


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``fn``; describe how it ended (error type names, message, rank, timing)."""
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - described for the test
        cause = exc.__cause__
        return {"ok": False, "types": [c.__name__ for c in type(exc).__mro__],
                "cause": type(cause).__name__ if cause is not None else "",
                "msg": str(exc), "rank": getattr(exc, "rank", None),
                "missing": tuple(getattr(exc, "missing", ())),
                "elapsed": time.monotonic() - start, "at": time.time()}
    return {"ok": True, "elapsed": time.monotonic() - start, "at": time.time()}


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors, or of (nested) lists and dicts of them."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)
