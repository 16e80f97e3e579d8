"""Model averaging (torch's ``torch.distributed.algorithms.model_averaging``): ranks train
on their own and average their parameters every few steps, on tandem's collectives.

``averagers.PeriodicModelAverager`` averages over one group every ``period`` steps;
``hierarchical_model_averager.HierarchicalModelAverager`` averages over groups of growing
size at growing periods; ``utils`` has the averaging itself. With DDP's
``post_localSGD_hook`` and ``tandem.optim.PostLocalSGDOptimizer`` they run post-local
SGD (https://arxiv.org/abs/1808.07217)::

    averager = averagers.PeriodicModelAverager(period=4, warmup_steps=100)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), averager)
"""

from tandem.algorithms.model_averaging import averagers, hierarchical_model_averager, utils

__all__ = ["averagers", "hierarchical_model_averager", "utils"]
