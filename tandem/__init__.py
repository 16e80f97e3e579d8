"""tandem: distributed training for PyTorch on its own communication engine.

Porting a ``torch.distributed`` script is one changed import::

    import tandem as dist
    dist.init_process_group()            # env:// by default, as under torchrun
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

Every collective, point-to-point and object function of ``torch.distributed`` is
here with the same names, arguments and semantics; errors are the classes of
``tandem.errors``; settings are documented in ``tandem.config``.
"""

# no ``from __future__ import annotations`` and only private aliases at module level:
# ``dir(tandem)`` shows tandem's names and nothing else
import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

__version__ = "0.1.0"

# Public names resolve on first use (PEP 562): ``import tandem`` stays cheap, so the
# launcher (``tandemrun``) starts its workers without first importing torch.
_EXPORTS: dict[str, str] = {
    "register_algorithm": "tandem.collectives.algorithms",
    "all_gather": "tandem.collectives.api",
    "all_gather_into_tensor": "tandem.collectives.api",
    "all_gather_single": "tandem.collectives.api",
    "all_reduce": "tandem.collectives.api",
    "all_reduce_coalesced": "tandem.collectives.api",
    "all_to_all": "tandem.collectives.alltoall",
    "all_to_all_single": "tandem.collectives.alltoall",
    "barrier": "tandem.collectives.barriers",
    "broadcast": "tandem.collectives.api",
    "gather": "tandem.collectives.api",
    "monitored_barrier": "tandem.collectives.barriers",
    "reduce": "tandem.collectives.api",
    "reduce_scatter": "tandem.collectives.api",
    "reduce_scatter_single": "tandem.collectives.api",
    "reduce_scatter_tensor": "tandem.collectives.api",
    "scatter": "tandem.collectives.api",
    "OpStats": "tandem.collectives.debug_api",
    "dump_flight_recorder": "tandem.collectives.debug_api",
    "stats": "tandem.collectives.debug_api",
    "timeline": "tandem.collectives.debug_api",
    "Backend": "tandem.collectives.backend",
    "BackendOptions": "tandem.collectives.backend",
    "NonMemberGroup": "tandem.collectives.group",
    "ProcessGroup": "tandem.collectives.group",
    "get_global_rank": "tandem.collectives.subgroups",
    "get_group_rank": "tandem.collectives.subgroups",
    "get_process_group_ranks": "tandem.collectives.subgroups",
    "new_group": "tandem.collectives.subgroups",
    "new_subgroups": "tandem.collectives.subgroups",
    "new_subgroups_by_enumeration": "tandem.collectives.subgroups",
    "all_gather_object": "tandem.collectives.objects",
    "broadcast_object_list": "tandem.collectives.objects",
    "gather_object": "tandem.collectives.objects",
    "recv_object_list": "tandem.collectives.objects",
    "scatter_object_list": "tandem.collectives.objects",
    "send_object_list": "tandem.collectives.objects",
    "P2POp": "tandem.collectives.p2p",
    "batch_isend_irecv": "tandem.collectives.p2p",
    "irecv": "tandem.collectives.p2p",
    "isend": "tandem.collectives.p2p",
    "recv": "tandem.collectives.p2p",
    "send": "tandem.collectives.p2p",
    "ReduceOp": "tandem.collectives.reduce_op",
    "Work": "tandem.collectives.work",
    "destroy_process_group": "tandem.collectives.world",
    "get_backend": "tandem.collectives.world",
    "get_rank": "tandem.collectives.world",
    "get_world_size": "tandem.collectives.world",
    "init_process_group": "tandem.collectives.world",
    "is_available": "tandem.collectives.world",
    "is_initialized": "tandem.collectives.world",
    "GroupMember": "tandem.collectives.porting",
    "default_pg_timeout": "tandem.collectives.porting",
    "get_default_backend_for_device": "tandem.collectives.porting",
    "get_node_local_rank": "tandem.collectives.porting",
    "get_pg_count": "tandem.collectives.porting",
    "group": "tandem.collectives.porting",
    "is_backend_available": "tandem.collectives.porting",
    "is_gloo_available": "tandem.collectives.porting",
    "is_mpi_available": "tandem.collectives.porting",
    "is_nccl_available": "tandem.collectives.porting",
    "is_torchelastic_launched": "tandem.collectives.porting",
    "is_ucc_available": "tandem.collectives.porting",
    "is_xccl_available": "tandem.collectives.porting",
    "supports_complex": "tandem.collectives.porting",
    "DistBackendError": "tandem.errors",
    "DistError": "tandem.errors",
    "DistNetworkError": "tandem.errors",
    "DistStoreError": "tandem.errors",
    "QueueEmptyError": "tandem.errors",
    "FileStore": "tandem.store",
    "HashStore": "tandem.store",
    "PrefixStore": "tandem.store",
    "Store": "tandem.store",
    "TCPStore": "tandem.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        if not name.startswith("_"):  # a torch.distributed name tandem refuses: say why
            refused = _importlib.import_module("tandem.collectives.porting").refusal(name)
            if refused is not None:
                raise refused
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    public = {n for n in globals() if not n.startswith("_")}  # loaded names, subpackages
    return sorted(public | set(_EXPORTS) | {"__version__"})


if _TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from tandem.collectives.algorithms import register_algorithm
    from tandem.collectives.alltoall import all_to_all, all_to_all_single
    from tandem.collectives.api import (
        all_gather,
        all_gather_into_tensor,
        all_gather_single,
        all_reduce,
        all_reduce_coalesced,
        broadcast,
        gather,
        reduce,
        reduce_scatter,
        reduce_scatter_single,
        reduce_scatter_tensor,
        scatter,
    )
    from tandem.collectives.barriers import barrier, monitored_barrier
    from tandem.collectives.backend import Backend, BackendOptions
    from tandem.collectives.group import NonMemberGroup, ProcessGroup
    from tandem.collectives.subgroups import (
        get_global_rank,
        get_group_rank,
        get_process_group_ranks,
        new_group,
        new_subgroups,
        new_subgroups_by_enumeration,
    )
    from tandem.collectives.debug_api import OpStats, dump_flight_recorder, stats, timeline
    from tandem.collectives.objects import (
        all_gather_object,
        broadcast_object_list,
        gather_object,
        recv_object_list,
        scatter_object_list,
        send_object_list,
    )
    from tandem.collectives.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
    from tandem.collectives.porting import (
        GroupMember,
        default_pg_timeout,
        get_default_backend_for_device,
        get_node_local_rank,
        get_pg_count,
        group,
        is_backend_available,
        is_gloo_available,
        is_mpi_available,
        is_nccl_available,
        is_torchelastic_launched,
        is_ucc_available,
        is_xccl_available,
        supports_complex,
    )
    from tandem.collectives.reduce_op import ReduceOp
    from tandem.collectives.work import Work
    from tandem.collectives.world import (
        destroy_process_group,
        get_backend,
        get_rank,
        get_world_size,
        init_process_group,
        is_available,
        is_initialized,
    )
    from tandem.errors import (
        DistBackendError,
        DistError,
        DistNetworkError,
        DistStoreError,
        QueueEmptyError,
    )
    from tandem.store import FileStore, HashStore, PrefixStore, Store, TCPStore
