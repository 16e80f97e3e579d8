"""tandem as a ``torch.distributed`` backend: unmodified torch code on tandem's engine.

Importing this package registers the backend ``"tandem"`` with torch (through
``torch.distributed.Backend.register_backend``, torch's public extension point)::

    import torch.distributed as dist
    import tandem.torch_backend              # registers "tandem"

    dist.init_process_group("tandem")         # or "cpu:tandem"; env:// under torchrun/tandemrun
    model = torch.nn.parallel.DistributedDataParallel(model)   # torch's own DDP, FSDP2, ZeRO...

From then on every ``torch.distributed`` collective, point-to-point call, object
collective and subgroup (``new_group``, ``new_subgroups``, DeviceMesh dimensions)
on CPU tensors runs on tandem: shared memory between ranks of one host, TCP across
hosts, with tandem's deadlines, mismatch detection and dead-rank naming. Failures
raise :class:`TandemBackendError`, a ``torch.distributed.DistBackendError`` carrying
tandem's message. ``torch.distributed.monitored_barrier``, which torch reserves for
gloo by name, is routed to tandem for tandem groups (see ``_monitored``).

``pg_options=tandem.torch_backend.Options(transport="tcp")`` picks the transport of a
group (``"auto"``, the default, ``"shm"`` or ``"tcp"``).

Rendezvous and security: torch's own TCPStore, which ``env://`` and ``tcp://`` set up
for every backend, has no authentication: anyone who can reach its port can read and
write the rendezvous and so join or disturb the job. tandem's connections between
ranks prove the job secret, but a job that rendezvouses through torch's store is only
as safe as that store's port. Importing this package therefore offers tandem's
authenticated store under torch (:class:`AuthenticatedStore`, the ``tandem://HOST:PORT``
init method) and uses it for ``env://`` and ``tcp://`` whenever the job secret is
given (``TANDEM_SECRET`` or ``TANDEM_SECRET_FILE``; ``tandemrun`` always gives one),
except under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``), which
only speaks torch's protocol. ``file://`` is as safe as the file's permissions. Every
rank of a job must make the same choice (the same secret variables set).

Not served, each refused with a message saying what to use instead: CUDA and other
accelerator tensors (and a ``"cpu:tandem,cuda:nccl"`` backend string, of which torch
would create only the tandem part), sparse tensors, ``barrier(device_ids=...)``, and
torch's per-device ``ProcessGroup._get_backend``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from tandem.errors import ArgumentError
from tandem.torch_backend._auth_store import AuthenticatedStore, register_rendezvous
from tandem.torch_backend._errors import TandemBackendError, translated
from tandem.torch_backend._fabric import join_group
from tandem.torch_backend._monitored import route_monitored_barrier
from tandem.torch_backend.process_group import BACKEND_NAME, TandemProcessGroup

__all__ = ["AuthenticatedStore", "BACKEND_NAME", "Options", "TandemBackendError", "TandemProcessGroup", "register"]


@dataclasses.dataclass(frozen=True)
class Options:
    """``pg_options`` for a "tandem" group: ``transport`` is "auto", "shm" or "tcp"."""

    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp"):
            raise ArgumentError(f"Options.transport must be 'auto', 'shm' or 'tcp', got "
                                f"{self.transport!r}")


def _create(options: Any, pg_options: Any) -> TandemProcessGroup:
    """torch's factory call for one process group (``extended_api=True``)."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise ArgumentError(f"pg_options for backend 'tandem' must be "
                            f"tandem.torch_backend.Options, got {type(pg_options).__name__}")
    transport = pg_options.transport if pg_options is not None else None
    group, fabric = translated(lambda: join_group(
        options.store, options.group_rank, options.group_size,
        list(options.global_ranks_in_group), str(options.group_id), options.timeout, transport))
    return TandemProcessGroup(group, fabric)


def register() -> None:
    """Register the backend "tandem" with torch (done on import; calling again is harmless)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    route_monitored_barrier()
    register_rendezvous()


register()
