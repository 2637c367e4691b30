"""Hooks for plain ``horovodrun`` scripts: per-rank batch sizes, sample-weighted gradients, elastic epochs.

The contract (see ``docs/horovod.md`` and ``examples/horovod_train.py``)::

    import horovod.torch as hvd
    import hetero_plugins.horovod as hh

    hvd.init()
    sampler = hh.HeteroBatchSampler(len(dataset), batch_size=32, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    optimizer = hh.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)   # collective: applies the plan made from the last epoch's timings
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

``batch_size`` is each rank's batch at the start; the global batch ``batch_size * hvd.size()`` never changes.
Rank i's gradient is scaled by its share b_i / B of the step's samples before Horovod sums (``op=hvd.Sum``),
so the update equals one process stepping on the union of the step's samples (LBB, Yao et al. 2024, and DBS,
Ye et al. 2020, aggregate exactly so; Horovod's default ``op=hvd.Average`` would weight every rank equally).
Each rank's compute time per step is measured from the moment its batch is drawn until its last gradient
is ready, before the all-reduce makes it wait for the others; at ``set_epoch`` the ranks all-gather these
records (``hvd.allgather``; ``mpi4py`` under a plain ``mpirun`` launch), every rank feeds them to its
:class:`~hetero_plugins.balancing.planner.BalancePlanner`, and rank 0's plan is broadcast (``hvd.broadcast_object``).

``DistributedOptimizer(..., aggregation=...)`` chooses how a step's work becomes one update (see
:mod:`hetero_plugins.aggregation`): ``"weighted"`` (the default, above), or ``"deadline"``, ``"wbsp"``,
``"pseudo_sync"``, ``"local_sgd"``, which return an :class:`AggregatingOptimizer` that exchanges through
``hvd.allreduce`` itself. ``"deadline"`` and ``"wbsp"`` cut each step into micro-batches handed out by
``optimizer.micro_batches(batch)`` (in the other modes it yields the batch once, so one loop serves all)::

    for batch in loader:
        optimizer.zero_grad()
        for x, y in optimizer.micro_batches(batch):
            loss_fn(model(x), y).backward()
        optimizer.step()
    optimizer.flush()   # after training: pseudo_sync applies its last gradient, still in flight

Elastic Horovod: the sampler's :meth:`HeteroBatchSampler.state_dict` holds the epoch, the steps done and
the planner, and the sampler registers itself with ``hvd.elastic.TorchState`` (pass it as a keyword
argument, e.g. ``TorchState(model, optimizer, sampler=sampler)``). After a reset with another world size the
samples of the interrupted epoch that no committed step processed are re-split over the new ranks under a
fresh plan for the same global batch, so none is lost or repeated (see :func:`unprocessed_indices`).

Horovod 0.28.1 needs a one-line C++17 patch to build against torch >= 2.1 (horovod#3996); ``make horovod``
builds and caches it. ``import hetero_plugins.horovod`` works without Horovod; using it needs Horovod.
"""

from __future__ import annotations

from hetero_plugins.balancing.partition import resplit_unprocessed, segment_layout, segment_shards, unprocessed_indices
from hetero_plugins.horovod.exchange import HorovodExchange, MPIExchange, get_exchange
from hetero_plugins.horovod.optimizer import AggregatingOptimizer, DistributedOptimizer
from hetero_plugins.horovod.sampler import HeteroBatchSampler
from hetero_plugins.horovod.weighting import GradientWeighting

__all__ = [
    "AggregatingOptimizer",
    "DistributedOptimizer",
    "GradientWeighting",
    "HeteroBatchSampler",
    "HorovodExchange",
    "MPIExchange",
    "get_exchange",
    "resplit_unprocessed",
    "segment_layout",
    "segment_shards",
    "unprocessed_indices",
]
