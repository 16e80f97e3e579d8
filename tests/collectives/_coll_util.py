"""Helpers of the collectives tests: per-rank inputs, locally computed answers, comparisons.

Inputs are chosen so that every reduction is *exact* in every dtype (small integers for
sums, powers of two for products, wrap-around for integer overflow, which is the same in
any order). So an algorithm that combines in a different order from the naive oracle
must still agree with it bit for bit, and a difference is always a bug.

Failure messages name the rank, the operation and the first element that differed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]
ALGORITHMS = ["naive", "doubling", "ring"]
LONELY_SIZE = 3  # the size of the ``lonely`` group of conftest; the test process is rank 1

_COMBINE: dict[str, Callable[..., torch.Tensor]] = {
    # torch's own kernels, applied in rank order; on bool, add is "or" and mul is "and"
    "SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
    "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def op_defined(op: str, dtype: torch.dtype) -> bool:
    """Whether torch defines ``op`` on ``dtype`` (what tandem must accept)."""
    if op in ("BAND", "BOR", "BXOR"):
        return not (dtype.is_floating_point or dtype.is_complex)
    if op == "AVG":
        return dtype.is_floating_point or dtype.is_complex
    if op in ("MIN", "MAX"):
        return not dtype.is_complex
    return True


def _pick(values: Sequence[Any], numel: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    index = torch.randint(0, len(values), (numel,), generator=g)
    table = torch.tensor(values, dtype=torch.complex128 if dtype.is_complex else torch.float64)
    return table[index].to(dtype)


def rank_input(op: str, dtype: torch.dtype, numel: int, rank: int, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input for an exact ``op`` reduction over ``numel`` elements."""
    seed = 1_000_003 * rank + 7_919 * numel + 101 * OPS.index(op) + DTYPES.index(dtype) + salt
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if op == "PRODUCT":
        if dtype.is_complex:
            return _pick([1, -1, 1j, -1j, 2, 1 + 1j], numel, g, dtype)
        if dtype.is_floating_point:
            return _pick([1, -1, 2, -2, 0.5], numel, g, dtype)
        return torch.randint(-3, 4, (numel,), generator=g).to(dtype)  # wraps: exact anyway
    if dtype.is_complex:
        parts = torch.randint(-8, 9, (2, numel), generator=g).double()
        return torch.complex(parts[0], parts[1]).to(dtype)
    if dtype.is_floating_point:
        if op in ("MIN", "MAX"):
            return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)  # sums stay exact
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
    return torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reduce_locally(op: str, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The reduction computed in this process with torch kernels, in rank order."""
    acc = inputs[0].clone()
    for x in inputs[1:]:
        acc = _COMBINE[op](acc, x)
    if op == "AVG":
        acc.div_(len(inputs))
    return acc


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """``None`` when equal in dtype, shape and values; else what differed first."""
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)}, expected {list(expected.shape)}"
    if torch.equal(actual, expected):
        return None
    a, e = actual.reshape(-1), expected.reshape(-1)
    wrong = (a != e).nonzero().reshape(-1)
    i = int(wrong[0])
    return (f"element {i} is {a[i].item()!r}, expected {e[i].item()!r} "
            f"({wrong.numel()} of {a.numel()} elements differ)")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    problem = first_difference(actual, expected)
    assert problem is None, f"{where}: {problem}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def watch_collective_sends(transport: Any, note: Callable[[int, Any, memoryview], None]) -> None:
    """From now on, call ``note(peer, header, payload)`` for every collective message
    ``transport`` sends (point-to-point and control messages are not collective ones)."""
    from tandem.transport.message import Kind

    plain = transport.isend

    def isend(peer: int, header: Any, payload: memoryview) -> Any:
        if header.kind == Kind.COLL:
            note(peer, header, payload)
        return plain(peer, header, payload)

    transport.isend = isend


def join_on_host(rank: int, p: int, hosts: str, store: str, gloo: bool, timeout: float) -> None:
    """Start tandem's default group (and gloo's when ``gloo``) in a child of ``launch``
    whose host is ``hosts[rank]`` (``TANDEM_HOST_ID``), through FileStores in ``store``."""
    import datetime
    import os

    import tandem

    os.environ["TANDEM_HOST_ID"] = f"host-{hosts[rank]}"
    tandem.init_process_group("auto", init_method=f"file://{store}/tandem", rank=rank,
                              world_size=p, timeout=timeout)
    if gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}/gloo", rank=rank,
                                world_size=p, timeout=datetime.timedelta(seconds=timeout))


def leave_hosts(gloo: bool) -> None:
    """End what :func:`join_on_host` started."""
    import tandem

    tandem.destroy_process_group()
    if gloo:
        import torch.distributed as dist

        dist.destroy_process_group()
