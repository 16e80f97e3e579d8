"""tandem: distributed training for PyTorch on its own communication engine.

Porting a ``torch.distributed`` script is one changed import::

    import tandem as dist
    dist.init_process_group()            # env:// by default, as under torchrun
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

Every collective, point-to-point and object function of ``torch.distributed`` is
here with the same names, arguments and semantics; errors are the classes of
``tandem.errors``; settings are documented in ``tandem.config``.
"""

from tandem.collectives.api import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from tandem.collectives.algorithms import register_algorithm
from tandem.collectives.backend import Backend, BackendOptions
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.groups import (
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from tandem.collectives.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from tandem.collectives.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
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
from tandem.store import FileStore, HashStore, PrefixStore, Store, TCPStore

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendOptions", "FileStore", "HashStore", "NonMemberGroup", "P2POp",
    "PrefixStore", "ProcessGroup", "ReduceOp", "Store", "TCPStore", "Work",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "destroy_process_group", "gather", "gather_object", "get_backend", "get_global_rank",
    "get_group_rank", "get_process_group_ranks", "get_rank", "get_world_size",
    "init_process_group", "irecv", "is_available", "is_initialized", "isend",
    "monitored_barrier", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "recv",
    "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "register_algorithm", "scatter", "scatter_object_list", "send", "send_object_list",
]
