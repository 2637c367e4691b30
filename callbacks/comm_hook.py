"""A DDP communication hook that sums gradients weighted by each rank's share of the step's samples.

DDP's default hook divides every rank's gradient by the world size and sums, which is the mean over the
step's samples only when every rank has the same batch. With per-rank batch sizes b_i the right update is
sum_i (b_i / B) g_i, where g_i is rank i's mean gradient and B = sum_i b_i (LBB and DBS aggregate exactly
so: Yao et al. 2024; Ye et al. 2020). The hook also time-stamps the moment each bucket becomes ready on
this rank, which is how the telemetry measures compute time before any wait for other ranks.

Register it yourself with ``ddp_model.register_comm_hook(state, weighted_allreduce_hook)``: Lightning's
``DDPStrategy(ddp_comm_hook=...)`` is silently ignored on CPU (it registers hooks only for CUDA).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against the real types.
from typing import Any, Optional

import torch
import torch.distributed as dist

from hetero_plugins.telemetry import StepTimer

__all__ = ["WeightedAllreduceState", "check_one_weighting", "weighted_allreduce_hook"]


class WeightedAllreduceState:
    """State of :func:`weighted_allreduce_hook`.

    Attributes:
        weight: this rank's share of the current step's samples, b_i / B (set before every step).
        process_group: the group to all-reduce over (``None``: the default group).
        timer: telemetry to notify when a bucket of gradients is ready (optional).
        calls: number of buckets reduced so far (for diagnostics and tests).
        bytes: bytes of gradient buckets this rank sent into all-reduces so far.
    """

    __slots__ = ("bytes", "calls", "process_group", "timer", "weight")

    def __init__(self, weight: float, process_group: Any = None, timer: Optional[StepTimer] = None) -> None:
        self.weight = float(weight)
        self.process_group = process_group
        self.timer = timer
        self.calls = 0
        self.bytes = 0


def weighted_allreduce_hook(state: WeightedAllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scale this rank's bucket by ``state.weight`` and all-reduce with SUM."""
    if state.timer is not None:
        state.timer.mark_gradients_ready()
    state.calls += 1
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    buffer.mul_(state.weight)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def check_one_weighting(callbacks: Any, me: Any) -> None:
    """``ValueError`` when another of ``callbacks`` also registers the weighted hook (``registers_weighted_hook``):
    torch lets a DDP model have one comm hook, and two weightings of the same gradients would be one too many."""
    others = [cb for cb in callbacks if cb is not me and getattr(cb, "registers_weighted_hook", False)]
    if others:
        names = sorted({type(me).__name__, *(type(cb).__name__ for cb in others)})
        who = " and ".join(names) if len(names) > 1 else f"{len(others) + 1} {names[0]} callbacks"
        raise ValueError(
            f"{who} each weight the gradients with a DDP comm hook, and a model takes one "
            f"({len(others) + 1} callbacks would register it). HINT: keep one: with strategy='hetero_ddp' (it brings "
            "its own BatchBalancer) pass the balancer's options to the strategy and leave BatchBalancer and "
            "StragglerMonitor out; beside strategy='ddp' use either BatchBalancer (it balances and records the "
            "straggler metrics) or StragglerMonitor (it only measures)."
        )
