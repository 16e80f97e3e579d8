"""Data-parallel training on tandem: the ``torch.nn.parallel`` / ``torch.utils.data`` names.

``DistributedDataParallel`` (with ``comm_hooks``), ``DistributedSampler`` and
``SyncBatchNorm`` have torch's signatures and semantics::

    import tandem as dist
    from tandem.parallel import DistributedDataParallel as DDP, DistributedSampler

    dist.init_process_group()                 # under tandemrun / torchrun (env://)
    model = DDP(SyncBatchNorm.convert_sync_batchnorm(model))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))

A complete job: ``examples/train_chars.py``.
"""

from tandem.parallel import comm_hooks
from tandem.parallel.ddp import DistributedDataParallel
from tandem.parallel.sampler import DistributedSampler
from tandem.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "DistributedSampler", "SyncBatchNorm", "comm_hooks"]
