"""``RemoteModule``: an ``nn.Module`` whose module lives on another worker.

    emb = RemoteModule("ps/cpu", torch.nn.EmbeddingBag, args=(10_000, 64))
    model = torch.nn.Sequential(emb, tandem.parallel.DistributedDataParallel(dense))
    with tandem.autograd.context() as ctx:
        loss = loss_fn(model(ids), y)         # emb runs on "ps"; gradients flow back
        tandem.autograd.backward(ctx, [loss])
        DistributedOptimizer(SGD, emb.remote_parameters() + local_rrefs, lr=0.1).step(ctx)

``remote_device`` is ``"<worker name>/<device>"`` or ``"rank:<id>/<device>"``; the device
may be left out and must be the CPU (tandem's RPC moves CPU tensors). The module is
built on that worker when the RemoteModule is (construction errors are raised here).
``forward`` and ``forward_async`` run it there; ``remote_parameters()`` returns RRefs
to its parameters (for ``DistributedOptimizer``); ``get_module_rref()`` the module's.
Methods that would need the parameters here (``parameters``, ``to``, ``state_dict``...)
raise, saying what to use instead. A RemoteModule may travel through RPC.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NoReturn

import torch
from torch import nn

from tandem.errors import ArgumentError, StateError
from tandem.rpc import RRef, get_worker_info, rpc_async, rpc_sync
from tandem.rpc.worker import WorkerInfo

__all__ = ["RemoteModule"]


def parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """``"worker1/cpu"`` -> ("worker1", "cpu"); ``"rank:1"`` -> (1, "cpu")."""
    if not isinstance(remote_device, str) or not remote_device:
        raise ArgumentError(f"remote_device must be a string like 'worker1/cpu' or "
                            f"'rank:1/cpu', got {remote_device!r}")
    worker, _, device = remote_device.partition("/")
    if "/" in device or not worker:
        raise ArgumentError(f"remote_device {remote_device!r} must look like "
                            f"'<worker name>/<device>' or 'rank:<id>/<device>'")
    where: str | int = worker
    if worker.startswith("rank:"):
        try:
            where = int(worker[len("rank:"):])
        except ValueError:
            raise ArgumentError(f"remote_device {remote_device!r}: 'rank:' must be followed "
                                f"by an integer") from None
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ArgumentError(f"remote_device {remote_device!r}: {exc}") from exc
    if dev.type != "cpu":
        raise ArgumentError(f"remote_device {remote_device!r} asks for {dev}, but tandem's RPC "
                            f"moves CPU tensors only; use '<worker>/cpu'")
    return where, str(dev)


def _create(module_cls: Callable[..., nn.Module], args: tuple[Any, ...],
            kwargs: dict[str, Any], device: str) -> RRef[nn.Module]:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ArgumentError(f"RemoteModule: module_cls built a {type(module).__name__}, "
                            f"not an nn.Module")
    return RRef(module.to(device))


def _forward(module: RRef[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return module.local_value()(*args, **kwargs)


def _parameters(module: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    return [RRef(p) for p in module.local_value().parameters(recurse)]


def _train(module: RRef[nn.Module], mode: bool) -> None:
    module.local_value().train(mode)


class RemoteModule(nn.Module):
    """``module_cls(*args, **kwargs)`` built and run on ``remote_device``'s worker."""

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module],
                 args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
                 _module_interface_cls: Any = None) -> None:
        super().__init__()
        if _module_interface_cls is not None:
            raise ArgumentError("RemoteModule: _module_interface_cls (TorchScript) is not "
                                "supported; leave it unset")
        if not callable(module_cls):
            raise ArgumentError(f"RemoteModule: module_cls must be a module class, got "
                                f"{module_cls!r}")
        where, self.device = parse_remote_device(remote_device)
        self.on: WorkerInfo = get_worker_info(where) if isinstance(where, str) else \
            _info_of_rank(where)
        self.module_rref: RRef[nn.Module] = rpc_sync(
            self.on, _create, (module_cls, tuple(args or ()), dict(kwargs or {}), self.device))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: RRef[nn.Module],
                              _module_interface_cls: Any = None) -> "RemoteModule":
        """A RemoteModule for a module that already lives in ``module_rref`` (its owner
        must be the worker ``remote_device`` names)."""
        if _module_interface_cls is not None:
            raise ArgumentError("RemoteModule: _module_interface_cls is not supported")
        where, device = parse_remote_device(remote_device)
        on = get_worker_info(where) if isinstance(where, str) else _info_of_rank(where)
        if module_rref.owner() != on:
            raise ArgumentError(f"init_from_module_rref: the module lives on "
                                f"{module_rref.owner_name()!r}, not on {on.name!r}")
        self = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(self)
        self.on, self.device, self.module_rref = on, device, module_rref
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module on its worker; returns its output (autograd-connected inside a
        ``tandem.autograd.context``)."""
        return rpc_sync(self.on, _forward, (self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future[Any]:
        return rpc_async(self.on, _forward, (self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the module's parameters, e.g. for ``DistributedOptimizer``."""
        result: list[RRef[nn.Parameter]] = rpc_sync(self.on, _parameters,
                                                    (self.module_rref, recurse))
        return result

    def get_module_rref(self) -> RRef[nn.Module]:
        return self.module_rref

    def train(self, mode: bool = True) -> "RemoteModule":
        rpc_sync(self.on, _train, (self.module_rref, mode))
        self.training = mode
        return self

    def __reduce__(self) -> Any:
        return RemoteModule.init_from_module_rref, (f"{self.on.name}/{self.device}",
                                                    self.module_rref)

    def extra_repr(self) -> str:
        return f"on={self.on.name}/{self.device}"

    # -- what would need the module here ---------------------------------------------------
    def _refuse(self, name: str) -> NoReturn:
        raise StateError(
            f"RemoteModule.{name}() is not supported: the module lives on worker "
            f"{self.on.name!r}; use remote_parameters() for its parameters (e.g. for "
            f"DistributedOptimizer) or get_module_rref().rpc_sync() to call it there")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self._refuse("parameters")

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("named_parameters")

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        self._refuse("buffers")

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("named_buffers")

    def children(self) -> Iterator[nn.Module]:
        self._refuse("children")

    def named_children(self) -> Any:
        self._refuse("named_children")

    def modules(self, *args: Any, **kwargs: Any) -> Iterator[nn.Module]:
        self._refuse("modules")

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("named_modules")

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("state_dict")

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("load_state_dict")

    def to(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("to")

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        self._refuse("apply")

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        self._refuse("requires_grad_")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._refuse("zero_grad")

    def register_buffer(self, *args: Any, **kwargs: Any) -> None:
        self._refuse("register_buffer")

    def register_parameter(self, *args: Any, **kwargs: Any) -> None:
        self._refuse("register_parameter")


def _info_of_rank(rank: int) -> WorkerInfo:
    from tandem.rpc import _state

    agent = _state.require("RemoteModule")
    return agent.workers.infos[agent.workers.rank_of(rank)]


for _name in ("cuda", "cpu", "ipu", "xpu", "type", "float", "double", "half", "bfloat16",
              "share_memory", "add_module", "register_module", "register_forward_hook",
              "register_forward_pre_hook", "register_backward_hook",
              "register_full_backward_hook", "register_full_backward_pre_hook", "get_submodule",
              "get_parameter", "get_buffer", "to_empty"):
    setattr(RemoteModule, _name, (lambda name: lambda self, *a, **k: self._refuse(name))(_name))
