"""Data-parallel training on tandem: the ``torch.nn.parallel`` / ``torch.utils.data`` names.

``DistributedDataParallel`` (with ``comm_hooks``), ``DistributedSampler``,
``SyncBatchNorm``, ``DataParallel`` and its helpers (``scatter``, ``gather``,
``replicate``, ``parallel_apply``, ``data_parallel``) have torch's signatures and
semantics::

    import tandem as dist
    from tandem.parallel import DistributedDataParallel as DDP, DistributedSampler

    dist.init_process_group()                 # under tandemrun / torchrun (env://)
    model = DDP(SyncBatchNorm.convert_sync_batchnorm(model))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))

A complete job: ``examples/train_chars.py``.
"""

from tandem.parallel import comm_hooks
from tandem.parallel.data_parallel import DataParallel, data_parallel
from tandem.parallel.ddp import DistributedDataParallel
from tandem.parallel.parallel_apply import parallel_apply
from tandem.parallel.replicate import replicate
from tandem.parallel.sampler import DistributedSampler
from tandem.parallel.scatter_gather import gather, scatter
from tandem.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["DataParallel", "DistributedDataParallel", "DistributedSampler", "SyncBatchNorm",
           "comm_hooks", "data_parallel", "gather", "parallel_apply", "replicate", "scatter"]
