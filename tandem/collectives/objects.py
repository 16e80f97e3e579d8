"""Collectives on picklable Python objects.

Objects are pickled into byte tensors; sizes travel first so receivers allocate
exactly. Only authenticated peers of the job can send these bytes (every
connection proved the job secret), and unpickling runs only on what they sent.

An object that cannot be pickled fails on every rank of the call, not only where it
was given: that rank still takes part, sending minus the length of its error text
where a size belongs, then the text itself, so every rank raises an
:class:`~tandem.errors.ArgumentError` naming the rank, the entry and the reason
(instead of waiting for data that never comes).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from tandem.collectives import api, p2p
from tandem.collectives.checks import bool_arg, check_cpu_device, refused_alone, root_rank
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError, CollectiveMismatchError

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object",
           "scatter_object_list", "send_object_list", "recv_object_list"]


def _pack(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


class _Unpicklable(Exception):
    """An entry that could not be pickled: what to tell every rank, and why."""

    def __init__(self, text: str, cause: BaseException) -> None:
        super().__init__(text)
        self.text = text
        self.cause = cause

    def encoded(self) -> torch.Tensor:
        # never empty, so its negated length marks a failure unambiguously
        return torch.frombuffer(bytearray(self.text.encode() or b"?"), dtype=torch.uint8)


def _pack_all(what: str, name: str, objs: list[Any], rank: int) -> list[torch.Tensor]:
    packed = []
    for i, obj in enumerate(objs):
        try:
            packed.append(_pack(obj))
        except Exception as exc:  # noqa: BLE001 - any pickling failure is told to every rank
            raise _Unpicklable(f"{what}: {name}[{i}] ({type(obj).__name__}) on rank {rank} could "
                               f"not be pickled: {type(exc).__name__}: {exc}", exc) from exc
    return packed


def _refused(text: torch.Tensor, mine: _Unpicklable | None) -> ArgumentError:
    """The error every rank raises for a failure another rank (or this one) reported."""
    error = ArgumentError(bytes(text.tolist()).decode(errors="replace"))
    if mine is not None:
        error.__cause__ = mine.cause
    return error


def _unpack(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


def _packed_one(what: str, obj: Any, rank: int) -> torch.Tensor | _Unpicklable:
    try:
        return _pack_all(what, "obj", [obj], rank)[0]
    except _Unpicklable as exc:
        return exc


def _sizes(group: AnyGroup | None, mine: torch.Tensor | _Unpicklable) -> list[int]:
    """Every rank's pickled size; raises on every rank if any rank's object failed."""
    g = resolve_group(group, "object collective")
    failed = mine if isinstance(mine, _Unpicklable) else None
    n = -failed.encoded().numel() if failed is not None else mine.numel()  # type: ignore[union-attr]
    all_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(g.group_size)]
    api.all_gather(all_sizes, torch.tensor([n], dtype=torch.int64), group=group)
    sizes = [int(s.item()) for s in all_sizes]
    if min(sizes) >= 0:
        return sizes
    # every rank's error text (empty where none), so every rank names every failure
    width = max(-s for s in sizes)
    texts = [torch.empty(width, dtype=torch.uint8) for _ in sizes]
    api.all_gather(texts, _pad(failed.encoded() if failed is not None
                               else torch.empty(0, dtype=torch.uint8), width), group=group)
    parts = [t[:-s] for t, s in zip(texts, sizes) if s < 0]
    raise _refused(torch.cat([torch.cat([p, torch.tensor(list(b"; "), dtype=torch.uint8)])
                              for p in parts])[:-2], failed)


def broadcast_object_list(object_list: list[Any], src: int | None = None,
                          group: AnyGroup | None = None, device: Any = None,
                          group_src: int | None = None) -> None:
    g = resolve_group(group, "broadcast_object_list")
    check_cpu_device("broadcast_object_list", "device", device)
    root = root_rank(g, "broadcast_object_list", src, group_src, "src")
    if not isinstance(object_list, list):
        # what the list holds differs by rank, so its type may too: the peers are in the call
        raise refused_alone(g, "broadcast_object_list", ArgumentError(
            f"broadcast_object_list: object_list must be a list, got "
            f"{type(object_list).__name__} on rank {g.ranks[g.group_rank]}"))
    sizes = torch.zeros(len(object_list), dtype=torch.int64)
    packed: list[torch.Tensor] = []
    failed: _Unpicklable | None = None
    if g.group_rank == root:
        try:
            packed = _pack_all("broadcast_object_list", "object_list", object_list,
                               g.ranks[root])
            sizes = torch.tensor([t.numel() for t in packed], dtype=torch.int64)
        except _Unpicklable as exc:
            failed, packed = exc, [exc.encoded()]
            sizes[0] = -packed[0].numel()
    try:
        api.broadcast(sizes, group=group, group_src=root)
    except CollectiveMismatchError as exc:
        # the sizes' shape is the list's length: a rank whose list is longer or shorter
        # than the source's made a different call
        raise CollectiveMismatchError(
            f"broadcast_object_list: object_list has {len(object_list)} entries on rank "
            f"{g.ranks[g.group_rank]}, and another rank's list has a different length; "
            f"every rank passes a list as long as the source's ({exc})") from exc
    data = torch.cat(packed) if packed else torch.empty(int(sizes.abs().sum()), dtype=torch.uint8)
    api.broadcast(data, group=group, group_src=root)
    if len(sizes) and sizes[0] < 0:
        raise _refused(data, failed)
    if g.group_rank != root:
        offset = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _unpack(data[offset:offset + n])
            offset += n


def all_gather_object(object_list: list[Any], obj: Any, group: AnyGroup | None = None) -> None:
    g = resolve_group(group, "all_gather_object")
    if not isinstance(object_list, list) or len(object_list) != g.group_size:
        raise ArgumentError(f"all_gather_object: object_list must be a list of {g.group_size}")
    mine = _packed_one("all_gather_object", obj, g.ranks[g.group_rank])
    sizes = _sizes(group, mine)
    assert isinstance(mine, torch.Tensor)  # else _sizes raised
    outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    api.all_gather(outs, mine, group=group)
    for i, t in enumerate(outs):
        object_list[i] = _unpack(t)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: AnyGroup | None = None, group_dst: int | None = None) -> None:
    g = resolve_group(group, "gather_object")
    root = root_rank(g, "gather_object", dst, group_dst, "dst")
    if g.group_rank == root and (not isinstance(object_gather_list, list)
                                 or len(object_gather_list) != g.group_size):
        raise refused_alone(g, "gather_object", ArgumentError(
            f"gather_object: the destination (rank {g.ranks[root]}) must pass "
            f"object_gather_list, a list of {g.group_size}; got {_shown(object_gather_list)}"))
    if g.group_rank != root and object_gather_list is not None:
        # never filled here: a caller expecting it filled would find it untouched (torch
        # refuses it too)
        raise refused_alone(g, "gather_object", ArgumentError(
            f"gather_object: object_gather_list is used only on the destination rank "
            f"(dst={g.ranks[root]}); rank {g.ranks[g.group_rank]} must pass None; "
            f"all_gather_object fills a list on every rank"))
    mine = _packed_one("gather_object", obj, g.ranks[g.group_rank])
    sizes = _sizes(group, mine)
    assert isinstance(mine, torch.Tensor)  # else _sizes raised
    if g.group_rank == root:
        # sizes differ per rank, so gather the padded maximum and trim
        width = max(sizes)
        padded = [torch.empty(width, dtype=torch.uint8) for _ in sizes]
        api.gather(_pad(mine, width), padded, group=group, group_dst=root)
        assert object_gather_list is not None
        for i, (t, n) in enumerate(zip(padded, sizes)):
            object_gather_list[i] = _unpack(t[:n])
    else:
        api.gather(_pad(mine, max(sizes)), None, group=group, group_dst=root)


def _shown(lst: object) -> str:
    """A root-only list argument as an error message shows it: its type, and its length."""
    if isinstance(lst, list):
        return f"a list of {len(lst)}"
    return "None" if lst is None else type(lst).__name__


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(width, dtype=torch.uint8)
    out[: t.numel()] = t
    return out


def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: AnyGroup | None = None,
                        group_src: int | None = None) -> None:
    g = resolve_group(group, "scatter_object_list")
    root = root_rank(g, "scatter_object_list", src, group_src, "src")
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ArgumentError("scatter_object_list: scatter_object_output_list must be a "
                            "non-empty list")
    sizes = torch.zeros(g.group_size, dtype=torch.int64)
    packed: list[torch.Tensor] = []
    failed: _Unpicklable | None = None
    if g.group_rank == root:
        if (not isinstance(scatter_object_input_list, list)
                or len(scatter_object_input_list) != g.group_size):
            raise refused_alone(g, "scatter_object_list", ArgumentError(
                f"scatter_object_list: the source (rank {g.ranks[root]}) must pass "
                f"scatter_object_input_list, a list of {g.group_size}; got "
                f"{_shown(scatter_object_input_list)}"))
        try:
            packed = _pack_all("scatter_object_list", "scatter_object_input_list",
                               scatter_object_input_list, g.ranks[root])
            sizes = torch.tensor([t.numel() for t in packed], dtype=torch.int64)
        except _Unpicklable as exc:
            failed = exc
            sizes[0] = -exc.encoded().numel()
    api.broadcast(sizes, group=group, group_src=root)
    if sizes[0] < 0:
        text = failed.encoded() if failed is not None else torch.empty(int(-sizes[0]),
                                                                         dtype=torch.uint8)
        api.broadcast(text, group=group, group_src=root)
        raise _refused(text, failed)
    width = int(sizes.max())
    out = torch.empty(width, dtype=torch.uint8)
    ins = [_pad(t, width) for t in packed] if packed else None
    api.scatter(out, ins, group=group, group_src=root)
    scatter_object_output_list[0] = _unpack(out[: int(sizes[g.group_rank])])


def send_object_list(object_list: list[Any], dst: int | None = None,
                     group: AnyGroup | None = None, device: Any = None,
                     group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to ``dst`` (sizes first, then the bytes).

    ``use_batch=True`` posts both sends through :func:`batch_isend_irecv`, as torch does.
    """
    check_cpu_device("send_object_list", "device", device)
    bool_arg(use_batch, "send_object_list", "use_batch")
    if not isinstance(object_list, list):
        raise ArgumentError("send_object_list: object_list must be a list")
    g = resolve_group(group, "send_object_list")
    failed: _Unpicklable | None = None
    try:
        packed = _pack_all("send_object_list", "object_list", object_list,
                           g.ranks[g.group_rank])
        sizes = torch.tensor([t.numel() for t in packed], dtype=torch.int64)
    except _Unpicklable as exc:
        # the receiver is told instead of left waiting for the bytes
        failed, packed = exc, [exc.encoded()]
        sizes = torch.zeros(len(object_list), dtype=torch.int64)
        sizes[0] = -packed[0].numel()
    data = torch.cat(packed) if packed else torch.empty(0, dtype=torch.uint8)
    _send_object_bytes(sizes, data, dst, group, group_dst, use_batch)
    if failed is not None:
        raise _refused(failed.encoded(), failed)


def _send_object_bytes(sizes: torch.Tensor, data: torch.Tensor, dst: int | None,
                       group: AnyGroup | None, group_dst: int | None, use_batch: bool) -> None:
    if use_batch:
        ops = [p2p.P2POp(p2p.isend, t, dst, group, group_peer=group_dst) for t in (sizes, data)]
        for work in p2p.batch_isend_irecv(ops):
            work.wait()
        return
    p2p.send(sizes, dst, group, group_dst=group_dst)
    p2p.send(data, dst, group, group_dst=group_dst)


def recv_object_list(object_list: list[Any], src: int | None = None,
                     group: AnyGroup | None = None, device: Any = None,
                     group_src: int | None = None, use_batch: bool = False) -> int:
    """Fill ``object_list`` in place; return the sender's global rank.

    ``use_batch=True`` receives the sizes through :func:`batch_isend_irecv`, as torch
    does (from a given ``src`` only: a batch names its peers).
    """
    check_cpu_device("recv_object_list", "device", device)
    bool_arg(use_batch, "recv_object_list", "use_batch")
    if not isinstance(object_list, list):
        raise ArgumentError("recv_object_list: object_list must be a list")
    sizes = torch.zeros(len(object_list), dtype=torch.int64)
    if use_batch:
        if src is None and group_src is None:
            raise ArgumentError("recv_object_list: use_batch=True needs src (or group_src); "
                                "batch_isend_irecv receives from a named rank")
        p2p.batch_isend_irecv([p2p.P2POp(p2p.irecv, sizes, src, group,
                                         group_peer=group_src)])[0].wait()
        g = resolve_group(group, "recv_object_list")
        sender = g.ranks[root_rank(g, "recv_object_list", src, group_src, "src")]
    else:
        sender = p2p.recv(sizes, src, group, group_src=group_src)
    data = torch.empty(int(sizes.abs().sum()), dtype=torch.uint8)
    p2p.recv(data, sender, group)
    if len(sizes) and sizes[0] < 0:
        raise _refused(data, None)
    offset = 0
    for i, n in enumerate(sizes.tolist()):
        object_list[i] = _unpack(data[offset:offset + n])
        offset += n
    return sender
