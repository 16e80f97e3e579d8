"""Modules and differentiable collectives, with the names of ``torch.distributed.nn``:
``RemoteModule`` (a module on another RPC worker) and ``functional`` (collectives that
autograd differentiates), whose functions are also here, as in torch."""

from tandem.nn import functional
from tandem.nn.functional import (all_gather, all_reduce, all_to_all, all_to_all_single,
                                  broadcast, gather, reduce, reduce_scatter, scatter)
from tandem.nn.remote_module import RemoteModule

__all__ = ["RemoteModule", "functional", "broadcast", "gather", "scatter", "reduce",
           "reduce_scatter", "all_gather", "all_to_all", "all_to_all_single", "all_reduce"]
