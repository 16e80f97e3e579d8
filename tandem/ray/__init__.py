"""Run a tandem job on Ray: one actor per rank, placed by a placement group.

::

    import tandem
    from tandem.ray import ScalingConfig, Trainer

    def train(config):
        tandem.init_process_group()          # RANK, MASTER_ADDR ... are set by tandem.ray
        ...
        return tandem.get_rank()

    trainer = Trainer(train, train_loop_config={"lr": 0.1},
                      scaling_config=ScalingConfig(num_workers=4, cpus_per_worker=1,
                                                   placement_strategy="SPREAD"))
    print(trainer.fit())                     # each rank's return value: [0, 1, 2, 3]

The shape follows Ray Train's ``TorchTrainer`` (a scaling configuration, a function per
worker, ``fit()``) without depending on Ray Train. The driver

* reserves a placement group of ``num_workers`` bundles (``PACK``, ``SPREAD``,
  ``STRICT_SPREAD`` or ``STRICT_PACK``) and starts one actor in each; a job the live
  nodes can never hold is refused at once;
* numbers the ranks from where the actors landed: a node's ranks are contiguous, local
  ranks count within a node, rank 0 is bundle 0's actor, and ``MASTER_ADDR`` is rank
  0's node with a port free there;
* makes a new job secret and hands it to the actors in their call (never in a log or
  Ray's job configuration);
* prints each actor's output as it comes, every line prefixed with its rank
  (``[rank1]: ...``), and returns the ranks' return values in rank order;
* names a rank whose actor died (rank, node, host, pid and how Ray says it ended), or
  that raised, ahead of the ranks that failed because of it
  (:class:`~tandem.errors.WorkerFailedError`);
* with ``max_restarts=N`` and a training function under
  :func:`tandem.elastic.run_elastic`, keeps the survivors going when an actor dies and
  starts a replacement in the same bundle, which joins at the next commit and receives
  the state from a live rank (the membership store lives in the driver). The returned
  list is then by slot: a replacement's value stands where its lost rank's stood.

Without ``address`` (and with Ray not yet initialised) ``fit()`` calls ``ray.init()``:
Ray on this machine, or the cluster ``RAY_ADDRESS`` names; it shuts down what it started.
"""

from __future__ import annotations

from tandem.ray._scaling import STRATEGIES, ScalingConfig
from tandem.ray._trainer import Trainer

__all__ = ["ScalingConfig", "Trainer", "STRATEGIES"]
