"""RPC backend options, with torch's names: what ``init_rpc`` accepts and what it refuses.

    opts = TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20)
    tandem.rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts)

Every field is honoured or refused with a message:

* ``num_worker_threads`` sizes the server pool (threads running incoming calls at once;
  threads blocked in a nested RPC wait do not count, so nested calls never starve it;
  at most ``MAX_WORKER_THREADS``, 1024);
* ``rpc_timeout`` is the default deadline of every call, in seconds (0: none);
* ``init_method``: ``env://`` (MASTER_ADDR/MASTER_PORT), ``tcp://host:port`` or
  ``file:///path``, as for ``init_process_group``;
* ``devices`` and ``device_maps`` may name the CPU only: tandem moves CPU tensors, and
  accelerator placement it cannot test is refused rather than guessed;
* ``_transports`` picks the wire the way TensorPipe's names do: ``["uv"]`` is TCP only,
  ``["shm"]`` shared memory only, both (or None) shared memory within a host and TCP
  across hosts; ``_channels`` is refused (tensor bytes always travel beside the message).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import torch

from tandem.config import at_most
from tandem.errors import ArgumentError

__all__ = ["BackendType", "RpcBackendOptions", "TensorPipeRpcBackendOptions",
           "DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_NUM_WORKER_THREADS", "transport_backend"]

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_NUM_WORKER_THREADS = 16
MAX_WORKER_THREADS = 1024
DEFAULT_INIT_METHOD = "env://"
_TRANSPORTS = {frozenset({"uv"}): "tcp", frozenset({"shm"}): "shm",
               frozenset({"shm", "uv"}): "auto"}


class BackendType(enum.Enum):
    """RPC backends. torch's only one, TENSORPIPE, names tandem's engine here."""

    TENSORPIPE = "TENSORPIPE"


def check_timeout(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{what} must be a number of seconds, got {value!r}")
    if not value >= 0:  # NaN too
        raise ArgumentError(f"{what} must be >= 0 seconds (0: no deadline), got {value}")
    # infinity too: init_rpc failed with an OverflowError, and a wait on it would
    return float(at_most(what, value, threading.TIMEOUT_MAX,
                         "seconds, the longest wait this platform allows",
                         "give 0 for no deadline"))


def _check_cpu(device: Any, what: str) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # torch's meaning of a bare index in device maps
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ArgumentError(f"{what}: {device!r} is not a device") from exc
    if dev.type != "cpu":
        raise ArgumentError(
            f"{what} names {dev}, but tandem's RPC moves CPU tensors only; move tensors to "
            f"the CPU before sending them (and back on arrival), or drop the device map")
    return dev


class RpcBackendOptions:
    """Options every RPC backend takes: the default ``rpc_timeout`` (seconds; 0: none)
    and the rendezvous ``init_method``."""

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        self.rpc_timeout = check_timeout(rpc_timeout, "rpc_timeout")
        if not isinstance(init_method, str) or "://" not in init_method:
            raise ArgumentError(f"init_method must be a URL such as 'env://', "
                                f"'tcp://host:port' or 'file:///path', got {init_method!r}")
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's TensorPipe options, accepted field for field (see the module docstring)."""

    def __init__(self, *, num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD,
                 device_maps: dict[str, dict[Any, Any]] | None = None,
                 devices: list[Any] | None = None,
                 _transports: list[str] | None = None,
                 _channels: list[str] | None = None) -> None:
        super().__init__(rpc_timeout, init_method)
        if isinstance(num_worker_threads, bool) or not isinstance(num_worker_threads, int) \
                or num_worker_threads < 1:
            raise ArgumentError(f"num_worker_threads must be an int >= 1, "
                                f"got {num_worker_threads!r}")
        at_most("num_worker_threads", num_worker_threads, MAX_WORKER_THREADS,
                "threads a worker may run calls on at once; more exhaust the process's "
                "threads before they help", f"use the default ({DEFAULT_NUM_WORKER_THREADS}) "
                f"or a few hundred at most")
        self.num_worker_threads = num_worker_threads
        self.devices: list[torch.device] = []
        self.set_devices(devices or [])
        if device_maps is not None and not isinstance(device_maps, dict):
            # an AttributeError on .items() before
            raise ArgumentError(f"device_maps must be a dict of worker name -> device map, "
                                f"got {type(device_maps).__name__}")
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {}
        for worker, mapping in (device_maps or {}).items():
            self.set_device_map(worker, mapping)
        if _transports is not None:
            transport_backend(_transports)  # refuse unknown names now, not at init_rpc
        self._transports = None if _transports is None else list(_transports)
        if _channels is not None:
            raise ArgumentError(
                f"_channels={_channels!r}: tandem has no TensorPipe channels (tensor bytes "
                f"always travel beside the pickled message, through shared memory or TCP); "
                f"leave _channels unset")
        self._channels = None

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Record how devices map when sending to worker ``to``: CPU to CPU only."""
        if not isinstance(to, str) or not to:
            raise ArgumentError(f"set_device_map: 'to' must be a worker name, got {to!r}")
        if not isinstance(device_map, dict):
            raise ArgumentError(f"set_device_map: device_map must be a dict, got "
                                f"{type(device_map).__name__}")
        mapping = {_check_cpu(k, f"device_maps[{to!r}]"): _check_cpu(v, f"device_maps[{to!r}]")
                   for k, v in device_map.items()}
        self.device_maps.setdefault(to, {}).update(mapping)

    def set_devices(self, devices: list[Any]) -> None:
        """The devices this worker uses: the CPU only."""
        if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
            raise ArgumentError(f"set_devices: devices must be a list, got {devices!r}")
        self.devices = [_check_cpu(d, "devices") for d in devices]


def transport_backend(transports: list[str] | None) -> str:
    """The tandem transport backend for TensorPipe transport names (None: "auto")."""
    if transports is None:
        return "auto"
    if isinstance(transports, str) or not all(isinstance(t, str) for t in transports):
        raise ArgumentError(f"_transports must be a list of names, got {transports!r}")
    backend = _TRANSPORTS.get(frozenset(transports))
    if backend is None:
        raise ArgumentError(
            f"_transports={transports!r}: tandem offers 'uv' (TCP) and 'shm' (shared "
            f"memory within a host); use ['uv'], ['shm'] or ['shm', 'uv']")
    return backend
