"""``TandemProcessGroup``: a ``torch.distributed.ProcessGroup`` that runs on tandem.

torch's backend factory returns one of these per process group; torch then calls
its methods from Python (``torch.distributed.*``) and from C++ through pybind11
(DDP's reducer, functional collectives). Each wraps a tandem
:class:`~tandem.collectives.group.ProcessGroup` on a shared
:class:`~tandem.torch_backend._fabric.Fabric`. The collective methods live in
:mod:`tandem.torch_backend._collectives`; this module has identity, lifetime,
the dispatch of one call (async or inline, the call's own timeout, error
translation), barriers and point-to-point.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tandem._words import secs
from tandem.collectives import api, barriers, p2p
from tandem.collectives.group import ProcessGroup
from tandem.collectives.work import Work
from tandem.errors import ArgumentError, CollectiveTimeoutError, StateError, TandemError
from tandem.torch_backend._collectives import Collectives
from tandem.torch_backend._errors import translate, translated
from tandem.torch_backend._fabric import Fabric
from tandem.torch_backend._options import one_tensor
from tandem.torch_backend._work import NO_TIMEOUT, TorchWork, seconds_or_none

__all__ = ["TandemProcessGroup", "BACKEND_NAME"]

BACKEND_NAME = "tandem"


class TandemProcessGroup(Collectives, dist.ProcessGroup):  # type: ignore[misc]
    """A torch process group whose every call runs on tandem's engine (CPU tensors)."""

    def __init__(self, group: ProcessGroup, fabric: Fabric) -> None:
        super().__init__(group.group_rank, group.group_size)  # type: ignore[call-arg]
        self._group = group
        self._fabric = fabric
        self._name = ""
        self._desc = ""
        self._config_checked = False
        self._coalesced: list[Work] | None = None
        self._shut = False

    # -- identity (torch reads these through pybind11) --------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: Any) -> Any:
        raise ArgumentError(
            f"process group '{self._name}' runs on tandem, implemented in Python: torch's "
            f"per-device Backend objects (ProcessGroup._get_backend({device!r})) do not exist "
            f"for it; use the process group's own methods")

    @property
    def tandem_group(self) -> ProcessGroup:
        """The tandem process group underneath (for tandem's own API and tests)."""
        return self._group

    def __repr__(self) -> str:
        return (f"<TandemProcessGroup '{self._name}' rank {self._group.group_rank} of "
                f"{self._group.group_size}, global ranks {self.global_ranks()}>")

    def global_ranks(self) -> list[int]:
        return [self._fabric.global_rank(r) for r in self._group.ranks]

    # -- lifetime ------------------------------------------------------------------------
    def set_timeout(self, timeout: datetime.timedelta) -> None:
        seconds = seconds_or_none(timeout)
        if seconds is None:
            raise ArgumentError(f"set_timeout: timeout must be positive, got {timeout}")
        self._group.timeout = seconds

    def shutdown(self) -> None:
        """Release this group; the fabric's last group closes its connections."""
        if not self._shut:
            self._shut = True
            try:
                self._group.close()
            finally:  # a broadcast's late mismatch is raised, the connections still go
                self._fabric.release(self._group.group_id)

    def abort(self) -> None:
        """Fail every pending and later call of this group, here and on every member."""
        me = self._fabric.global_rank(self._group.ranks[self._group.group_rank])
        self._group.abort(StateError(f"process group '{self._name}' was aborted on rank {me}"))
        self.shutdown()

    # -- one call --------------------------------------------------------------------------
    def _usable(self) -> ProcessGroup:
        """The tandem group, once this group's backend configuration has been checked."""
        if not self._config_checked:
            self._check_config()
        return self._group

    def _check_config(self) -> None:
        # torch builds a group from "cpu:tandem,cuda:nccl" by stopping at the first backend
        # that is a whole ProcessGroup (this one): the others are never created
        try:
            config = str(dist.get_backend_config(self))
        except (ValueError, RuntimeError, KeyError):
            config = ""  # a group made outside torch's registry
        others = [p.strip() for p in config.split(",")
                  if ":" in p and p.split(":")[1].strip() != BACKEND_NAME]
        if others:
            raise ArgumentError(
                f"process group '{self._name}' was created from backend '{config}', but torch "
                f"creates only the 'tandem' part of it ({', '.join(others)} never existed): "
                f"init with backend 'tandem' for CPU tensors and create a separate group for "
                f"accelerator tensors, e.g. torch.distributed.new_group(backend='nccl')")
        self._config_checked = True

    def _to_global(self, transport_rank: int) -> int:
        return self._fabric.global_rank(transport_rank)

    def _call(self, what: str, opts: Any, launch: Callable[..., Any], args: tuple[Any, ...],
              result: Any, after: Callable[[], None] | None = None) -> dist.Work | None:
        """Run one torch call: inline when torch will wait at once, else queued.

        An inline call returns None once its work is done (torch's Python API treats
        that as "synchronised by the backend"); every other call returns a handle.

        ``launch(*args, async_op)`` issues the tandem call(s) (a function and its
        arguments rather than a closure: this is every call's path). A call with its
        own timeout is queued and waited on here (or by the caller), and aborts the
        group when the timeout passes, as torch's backends do. ``after`` runs once the
        calls succeeded (see :class:`~tandem.torch_backend._work.TorchWork`).
        """
        limit = opts.timeout
        queued = opts.asyncOp or limit > NO_TIMEOUT or self._coalesced is not None
        try:
            issued = launch(*args, queued)
        except TandemError as exc:
            self._reraise(exc)
        if not queued:
            if after is not None:
                after()
            # finished already: torch's Python API waits on a returned handle and skips
            # the wait when there is none, which saves building and waiting on one
            return None
        timeout = seconds_or_none(limit)
        works = [w for w in (issued if isinstance(issued, list) else [issued]) if w is not None]
        if self._coalesced is not None:
            self._coalesced.extend(works)
        deadline = None if timeout is None else time.monotonic() + timeout
        work = TorchWork(works, result, self._to_global, deadline,
                         lambda: self._expire(what, timeout or 0.0), after)
        if not opts.asyncOp:
            work.wait()
        return work

    def _reraise(self, exc: TandemError) -> NoReturn:
        """Raise what torch code expects for a tandem failure (``translated()``, for
        callers that keep the ``try`` in their own frame: it costs nothing there)."""
        error = translate(exc, self._to_global)
        if error is exc:
            raise exc
        raise error from exc

    def _expire(self, what: str, timeout: float) -> TandemError:
        error = CollectiveTimeoutError(
            f"{what} on group '{self._name}' (global ranks {self.global_ranks()}) did not "
            f"complete within its timeout of {secs(timeout)}s; the group is aborted")
        self._group.abort(error)
        return error

    # -- coalescing (torch's _coalescing_manager with a device) ------------------------------
    def _start_coalescing(self, device: Any) -> None:
        if self._coalesced is not None:
            raise StateError(f"process group '{self._name}' is already coalescing")
        self._coalesced = []

    def _end_coalescing(self, device: Any) -> dist.Work:
        if self._coalesced is None:
            raise StateError(f"process group '{self._name}': _end_coalescing without "
                             f"_start_coalescing")
        works, self._coalesced = self._coalesced, None
        return TorchWork(works, None, self._to_global)

    # -- barriers ------------------------------------------------------------------------------
    def barrier(self, opts: c10d.BarrierOptions | None = None  # type: ignore[override]
                ) -> dist.Work:
        opts = opts or c10d.BarrierOptions()
        g = self._usable()
        if opts.device_ids:
            raise ArgumentError(f"barrier: device_ids={list(opts.device_ids)} select GPUs; the "
                                f"'tandem' backend synchronises CPU processes, drop device_ids")
        timeout = seconds_or_none(opts.timeout)
        issued = translated(lambda: barriers.barrier(g, bool(opts.asyncOp), timeout=timeout),
                            self._to_global)
        return TorchWork([issued] if issued is not None else [], None, self._to_global)

    def monitored_barrier(self, timeout: datetime.timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier whose rank 0 names the ranks that did not arrive within ``timeout``."""
        g = self._usable()
        seconds = seconds_or_none(timeout)
        translated(lambda: barriers.monitored_barrier(g, seconds, wait_all_ranks), self._to_global)

    # -- point-to-point ------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int) -> dist.Work:
        g = self._usable()
        t = one_tensor(tensors, "send")
        work = translated(lambda: p2p.isend(t, None, g, tag, group_dst=dstRank), self._to_global)
        return TorchWork([work], [t], self._to_global)

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int) -> dist.Work:
        g = self._usable()
        t = one_tensor(tensors, "recv")
        work = translated(lambda: p2p.irecv(t, None, g, tag, group_src=srcRank), self._to_global)
        return TorchWork([work], [t], self._to_global)

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int) -> dist.Work:
        g = self._usable()
        t = one_tensor(tensors, "recv_anysource")
        work = translated(lambda: p2p.irecv(t, None, g, tag), self._to_global)
        return TorchWork([work], [t], self._to_global)
