"""``torch.distributed.monitored_barrier`` for tandem groups.

torch's function refuses every backend but gloo by name before it reaches the
process group, although the group method it then calls
(``ProcessGroup.monitored_barrier(timeout, wait_all_ranks=...)``) is what tandem's
groups implement. Importing ``tandem.torch_backend`` therefore replaces the
function in ``torch.distributed`` with one that sends tandem groups to their method
and everything else, unchanged, to torch's original. Code that imported the function
by name before ``tandem.torch_backend`` keeps torch's, which raises torch's own error.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tandem.torch_backend.process_group import TandemProcessGroup

__all__ = ["route_monitored_barrier"]


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None,
                          wait_all_ranks: bool = False) -> Any:
        pg = group if group is not None else (c10d.GroupMember.WORLD
                                              if dist.is_initialized() else None)
        if not isinstance(pg, TandemProcessGroup):
            return original(group, timeout, wait_all_ranks)
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)  # torch accepts seconds, too
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier.tandem_routed = True  # type: ignore[attr-defined]
    return monitored_barrier


def route_monitored_barrier() -> None:
    """Install the routing function (once; torch's original stays reachable)."""
    if getattr(dist.monitored_barrier, "tandem_routed", False):
        return
    routed = _routed(dist.monitored_barrier)
    dist.monitored_barrier = routed
    c10d.monitored_barrier = routed
