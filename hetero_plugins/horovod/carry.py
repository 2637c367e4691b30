"""``aggregation="deadline"`` in a checkpoint: the micro-batches a rank carries into its next steps.

A ``deadline`` step may end with samples of this rank's share not processed yet: they wait in the aggregator's
:class:`~hetero_plugins.aggregation.deadline.CarryQueue` and run first in the next steps, while the sampler
counts their step as done. A mid-epoch checkpoint of the model, the optimizer and the sampler alone would
resume past them, so :meth:`AggregatingOptimizer.state_dict` also saves this rank's carried micro-batches
(their collated data) with where they were saved (:func:`carry_state`), and the first step after
:meth:`AggregatingOptimizer.load_state_dict` puts them back in line where the state still applies: the same
rank, the same world size, the sampler at the same step of the same epoch (:func:`restore_carry`). Elsewhere
the samples they hold cannot be processed in that epoch, and a ``RuntimeWarning`` says how many and why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from hetero_plugins.aggregation import Aggregator, StepContext
from hetero_plugins.aggregation.microbatch import MicroBatch

__all__ = ["CARRY_KEY", "carry_state", "restore_carry"]

#: The key of the carried micro-batches in :meth:`AggregatingOptimizer.state_dict` (``"deadline"`` only).
CARRY_KEY = "hetero_plugins.deadline_carry"


def carry_state(aggregator: Aggregator, rank: int, world: int, epoch: int, steps_done: int) -> dict[str, Any] | None:
    """This rank's carried micro-batches and where they were saved, or ``None`` for a mode that carries none.

    Args:
        aggregator: the optimizer's aggregator (``deadline``: it has a ``carry`` queue).
        rank: this rank.
        world: the number of ranks.
        epoch: the sampler's epoch.
        steps_done: the sampler's steps done in it (the carried samples belong to earlier steps).
    """
    carry = getattr(aggregator, "carry", None)
    if carry is None:
        return None
    items = carry.take_all()
    carry.extend(items)  # read, left in place
    return {
        "rank": int(rank),
        "world": int(world),
        "epoch": int(epoch),
        "steps_done": int(steps_done),
        "backlogs": None if aggregator.backlogs is None else [int(b) for b in aggregator.backlogs],
        "micro_batches": [{"data": mb.data, "samples": mb.samples, "owner": mb.owner, "step": mb.step,
                           "index": mb.index, "weight": mb.weight} for mb in items],
    }


def restore_carry(aggregator: Aggregator, saved: dict[str, Any], ctx: StepContext, epoch: int,
                  move: Callable[[Any], Any]) -> bool:
    """Put the micro-batches of ``saved`` (a :func:`carry_state`) back in line before step ``ctx.step`` of
    ``epoch``, where they still apply; else warn how many samples this rank will not process.

    Args:
        aggregator: the ``deadline`` aggregator (its carry was emptied when the state was loaded).
        saved: the carried micro-batches as saved.
        ctx: the step about to run.
        epoch: the sampler's epoch.
        move: puts a micro-batch's data on the training device.

    Returns:
        Whether they were restored.
    """
    rank, world = ctx.rank, len(ctx.counts)
    items = saved["micro_batches"]
    problems = []
    if saved["rank"] != rank:
        problems.append(f"it was saved on rank {saved['rank']} and is loaded on rank {rank}")
    if saved["world"] != world:
        problems.append(f"it was saved with {saved['world']} ranks and the job now has {world}")
    if (saved["epoch"], saved["steps_done"]) != (epoch, ctx.step):
        problems.append(f"it was saved after step {saved['steps_done']} of epoch {saved['epoch']}, and the sampler "
                        f"now starts step {ctx.step} of epoch {epoch}")
    carry = getattr(aggregator, "carry", None)
    if carry is None:
        problems.append(f"this optimizer runs aggregation={aggregator.mode!r}, which carries nothing")
    if not problems:
        carry.extend([MicroBatch(move(m["data"]), int(m["samples"]), int(m["owner"]), int(m["step"]),
                                 int(m["index"]), float(m["weight"])) for m in items])
        aggregator.backlogs = None if saved["backlogs"] is None else list(saved["backlogs"])
        return True
    backlogs = saved["backlogs"] or []
    who = f"rank {rank}"
    if saved["rank"] == rank:
        lost = sum(int(m["samples"]) for m in items)
    elif saved["world"] == world and rank < len(backlogs):
        lost = int(backlogs[rank])  # every rank's carry travels with the gradients
    else:
        lost, who = sum(int(b) for b in backlogs), "the ranks (in all)"
    if lost:
        warnings.warn(
            f"aggregation='deadline': when the optimizer state loaded was saved, {who} carried {lost} samples into "
            f"the next steps, which this epoch will not process: {'; '.join(problems)}. HINT: save each rank's own "
            "optimizer.state_dict() with its sampler.state_dict() and load both on the same rank, or checkpoint at "
            "an epoch end (nothing is carried then).",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
