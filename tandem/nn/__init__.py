"""Modules for distributed training, with the names of ``torch.distributed.nn``."""

from tandem.nn.remote_module import RemoteModule

__all__ = ["RemoteModule"]
