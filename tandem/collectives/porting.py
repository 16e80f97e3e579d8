"""The rest of ``torch.distributed``'s namespace that scripts use, so that a ported script
finds every name it reaches for: honoured where tandem has the thing, and otherwise
refused with what to do instead (never a bare ``AttributeError``)::

    import tandem as dist
    dist.all_reduce(t, group=dist.group.WORLD)      # the default group (None before init)
    if dist.is_nccl_available(): ...                # False: tandem moves CPU tensors
    local = dist.get_node_local_rank(fallback_rank=0)
    dist.init_device_mesh(...)                      # AttributeError saying what to use

``REFUSED`` maps each torch name tandem does not provide to the reason and the way out;
``tandem.__getattr__`` raises it as an ``AttributeError`` (so ``hasattr`` stays False).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from tandem.collectives import world
from tandem.collectives.backend import Backend, resolve_backend
from tandem.collectives.group import NON_GROUP_MEMBER
from tandem.collectives.reduce_op import ReduceOp, check_dtype
from tandem.collectives.cluster_env import env_int
from tandem.config import MAX_WORLD_SIZE, Settings, load_settings
from tandem.errors import ArgumentError, StateError, TandemError

__all__ = ["group", "GroupMember", "default_pg_timeout", "is_backend_available",
           "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
           "is_xccl_available", "is_torchelastic_launched", "get_node_local_rank",
           "get_pg_count", "get_default_backend_for_device", "supports_complex", "REFUSED",
           "refusal"]

# the deadline of a group's calls unless init_process_group or TANDEM_TIMEOUT say otherwise
default_pg_timeout = datetime.timedelta(seconds=Settings().timeout)


class _WorldMember(type):
    @property
    def WORLD(cls) -> Any:  # noqa: N802 - torch's name
        """The default group once ``init_process_group`` has run, None before."""
        return world.default_group() if world.is_initialized() else None


class GroupMember(metaclass=_WorldMember):
    """``GroupMember.WORLD`` is the default group; ``new_group`` gives a rank outside the
    new group a ``NonMemberGroup``, which compares equal to ``NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class group(metaclass=_WorldMember):  # noqa: N801 - torch's name
    """``group.WORLD``: the default group (None before ``init_process_group``)."""


def is_backend_available(backend: str) -> bool:
    """Whether ``init_process_group(backend=backend)`` can run here: tandem's own backends,
    'gloo' (served by tandem's 'auto'), and those registered with ``Backend``."""
    try:
        resolve_backend(backend)
    except ArgumentError:
        return False
    return True


def is_gloo_available() -> bool:
    """True: a script asking for 'gloo' gets tandem's 'auto' backend."""
    return True


def is_nccl_available() -> bool:
    """False: NCCL drives GPUs, and tandem moves CPU tensors."""
    return False


def is_mpi_available() -> bool:
    return False


def is_ucc_available() -> bool:
    return False


def is_xccl_available() -> bool:
    return False


def is_torchelastic_launched() -> bool:
    """Whether a launcher started this process and set the variables ``env://`` reads:
    ``tandemrun`` (it sets TANDEM_RUN_ID) or ``torchrun`` (TORCHELASTIC_RUN_ID)."""
    return load_settings().run_id is not None or "TORCHELASTIC_RUN_ID" in os.environ


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank among those of its node: LOCAL_RANK, which the launchers
    set; else ``fallback_rank``; else an error saying so."""
    if os.environ.get("LOCAL_RANK") is not None:
        return env_int(os.environ, "LOCAL_RANK", 0, MAX_WORLD_SIZE - 1,
                       f"this process's rank on its node, 0..{MAX_WORLD_SIZE - 1}")
    if fallback_rank is not None:
        return int(fallback_rank)
    raise StateError("get_node_local_rank: LOCAL_RANK is not set (tandemrun and torchrun "
                        "set it); pass fallback_rank= for a process started another way")


def get_pg_count() -> int:
    """How many process groups this process has made, the default group included
    (0 before ``init_process_group``)."""
    if not world.is_initialized():
        return 0
    w = world.world()
    return 1 + len(w.groups)


def get_default_backend_for_device(device: Any) -> str:
    """The backend tandem uses for ``device``: 'auto' for the CPU; other devices are
    refused (tandem moves CPU tensors)."""
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if not isinstance(kind, str):
        raise ArgumentError(f"device must be a str or a torch.device, got {device!r}")
    if kind.split(":")[0] != "cpu":
        raise ArgumentError(f"tandem moves CPU tensors only; there is no backend for {kind!r}")
    return Backend.AUTO


def supports_complex(reduceOp: Any) -> bool:  # noqa: N803 - torch's argument name
    """Whether a reduction with ``reduceOp`` takes complex tensors: SUM, AVG and PRODUCT
    do, MIN, MAX and the bitwise ops do not; a custom op is the user's function's call."""
    if not isinstance(reduceOp, ReduceOp):
        raise ArgumentError(f"supports_complex: expected a tandem.ReduceOp, got {reduceOp!r}")
    try:
        check_dtype(reduceOp, torch.complex64)
    except ArgumentError:
        return False
    return True


_BACKEND = ("torch's own backend objects; init_process_group takes tandem's backend names "
            "('auto', 'shm', 'tcp', or 'gloo'), and the options go to the functions")
_MESH = ("tandem has no DeviceMesh of its own; run torch's DeviceMesh (and FSDP2/DTensor) "
         "over tandem as a torch backend: import tandem.torch_backend and init torch's "
         "process group with backend='tandem'")
REFUSED: dict[str, str] = {
    "DeviceMesh": _MESH,
    "init_device_mesh": _MESH,
    "split_group": "make the groups with tandem.new_group or tandem.new_subgroups",
    "shrink_group": ("make a smaller group with tandem.new_group; to go on without a lost "
                     "rank, see tandem.elastic (in-place recovery)"),
    "all_gather_coalesced": "call tandem.all_gather once per tensor (torch deprecates it too)",
    "reduce_op": "use tandem.ReduceOp (torch deprecates reduce_op)",
    "breakpoint": ("tandem has no multi-rank debugger; TANDEM_STALL_WARN reports where every "
                   "rank is while one waits, and SIGUSR1 dumps the flight recorder"),
    "DebugLevel": ("tandem always checks that ranks call matching collectives (torch's DETAIL "
                   "level) and has no switch for it; TANDEM_DEBUG=1 shows tandem's own frames "
                   "in tracebacks"),
    "get_debug_level": "see tandem.DebugLevel's message",
    "set_debug_level": "see tandem.DebugLevel's message",
    "set_debug_level_from_env": "see tandem.DebugLevel's message",
    "rendezvous": ("init_process_group takes env://, tcp://host:port and file:///path "
                   "itself; tandem has no pluggable rendezvous handlers"),
    "register_rendezvous_handler": "see tandem.rendezvous's message",
    "Reducer": "DDP's bucketing lives in tandem.parallel.DistributedDataParallel",
    "Logger": "DDP's logging lives in tandem.parallel.DistributedDataParallel",
    "GradBucket": "comm hooks receive tandem.parallel's GradBucket (see tandem.parallel)",
    "BuiltinCommHookType": ("pass a hook from tandem.parallel's comm hooks to "
                            "DistributedDataParallel.register_comm_hook"),
    "ProcessGroupGloo": _BACKEND,
    "BackendConfig": _BACKEND,
    "get_backend_config": "tandem.get_backend(group) names a group's backend",
    "AllToAllOptions": _BACKEND, "AllreduceCoalescedOptions": _BACKEND,
    "AllreduceOptions": _BACKEND, "BarrierOptions": _BACKEND, "BroadcastOptions": _BACKEND,
    "GatherOptions": _BACKEND, "ReduceOptions": _BACKEND, "ReduceScatterOptions": _BACKEND,
    "ScatterOptions": _BACKEND,
    "record_comm": ("tandem's calls appear in torch.profiler as 'tandem.<op>' ranges, without "
                    "custom titles; the flight recorder (tandem.dump_flight_recorder) has "
                    "each call's site"),
}


class RefusedName(AttributeError, TandemError):
    """A ``torch.distributed`` name tandem does not provide, with what to use instead."""


def refusal(name: str) -> RefusedName | None:
    why = REFUSED.get(name)
    if why is None:
        return None
    return RefusedName(f"tandem has no {name} (torch.distributed.{name}): {why}")
