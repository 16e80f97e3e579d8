"""Worker identities: ``WorkerInfo(name, id)`` and the directory that resolves ``to``.

Every call names its destination as torch allows: a worker name, a rank (``id``) or a
``WorkerInfo``. Names are checked once at ``init_rpc`` (unique, at most 128 characters
of letters, digits, ``_``, ``-``, ``.`` and ``:``; no ``/``, which separates the worker
from the device in ``RemoteModule("worker1/cpu", ...)``).
"""

from __future__ import annotations

import re
from typing import Sequence

from tandem.errors import ArgumentError

__all__ = ["WorkerInfo", "Directory", "check_name"]

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


class WorkerInfo:
    """A worker's ``name`` and ``id`` (its rank in the RPC job)."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:  # noqa: A002 - torch's field name
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return WorkerInfo, (self.name, self.id)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(
            f"worker name {name!r} is not valid: use 1 to 128 letters, digits, '_', '-', '.' "
            f"or ':' (e.g. 'worker0'); '/' separates worker and device in remote devices")
    return name


NAMES_SHOWN = 16  # worker names an error lists


class Directory:
    """Every worker of the job, by rank; resolves the ``to`` argument of every call."""

    def __init__(self, names: Sequence[str], me: int) -> None:
        seen: dict[str, int] = {}
        for rank, name in enumerate(names):
            if name in seen:
                raise ArgumentError(f"workers {seen[name]} and {rank} both called init_rpc "
                                    f"with the name {name!r}; every worker needs its own name")
            seen[name] = rank
        self.infos = [WorkerInfo(n, r) for r, n in enumerate(names)]
        self._by_name = seen
        self.me = me

    def __len__(self) -> int:
        return len(self.infos)

    def known(self) -> str:
        # the first few: a job of 10**5 workers named them all in every such error
        shown = ", ".join(repr(i.name) for i in self.infos[:NAMES_SHOWN])
        more = len(self.infos) - NAMES_SHOWN
        return shown + (f" and {more} more" if more > 0 else "")

    def rank_of(self, to: object) -> int:
        """The rank that ``to`` (name, rank or WorkerInfo) names; ArgumentError otherwise."""
        if isinstance(to, str):
            rank = self._by_name.get(to)
            if rank is None:
                raise ArgumentError(f"there is no worker named {to!r}; the workers are "
                                    f"{self.known()}")
            return rank
        if isinstance(to, WorkerInfo):
            if not 0 <= to.id < len(self.infos) or self.infos[to.id] != to:
                raise ArgumentError(f"{to!r} is not a worker of this job; the workers are "
                                    f"{self.known()}")
            return to.id
        if isinstance(to, int) and not isinstance(to, bool):
            if not 0 <= to < len(self.infos):
                raise ArgumentError(f"worker id {to} is out of range: there are "
                                    f"{len(self.infos)} workers ({self.known()})")
            return to
        raise ArgumentError(f"'to' must be a worker name, id or WorkerInfo, got {to!r}")

    def name(self, rank: int) -> str:
        return self.infos[rank].name

    def label(self, rank: int) -> str:
        """How messages name a worker: ``'trainer1' (rank 2)``."""
        return f"'{self.infos[rank].name}' (rank {rank})"
