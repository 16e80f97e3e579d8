"""The RPC defaults, under the names ``torch.distributed.rpc.constants`` gives them."""

from tandem.rpc.options import (DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS,
                                DEFAULT_RPC_TIMEOUT_SEC)

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS",
           "DEFAULT_SHUTDOWN_TIMEOUT", "UNSET_RPC_TIMEOUT"]

DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # shutdown(timeout=0): wait for the others as long as they live
UNSET_RPC_TIMEOUT = -1.0  # a call's timeout=-1: the rpc_timeout given to init_rpc
