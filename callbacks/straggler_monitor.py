"""``StragglerMonitor``: measure stragglers under the stock ``"ddp"`` strategy without changing its maths.

It registers a comm hook that averages exactly as DDP's default hook does (each rank's gradient times
1/world_size, summed) and time-stamps when this rank's gradients are ready, so each rank's compute time is
measured before it waits for the others. At every epoch end the ranks all-gather their step times; the
straggler level (max - min) / mean and the idle fraction land in ``history`` and in the logger.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins._validation import check_bool
from hetero_plugins.balancing.coordinator import gather_records as balancing_gather
from hetero_plugins.callbacks._collectives import StrategyCollectives
from hetero_plugins.callbacks.comm_hook import WeightedAllreduceState, check_one_weighting, weighted_allreduce_hook
from hetero_plugins.collectives import release_process_group_at_exit
from hetero_plugins.metrics import idle_fraction, straggler_level
from hetero_plugins.telemetry import StepTimer

__all__ = ["StragglerMonitor", "gather_records"]


def gather_records(strategy: Any, records: np.ndarray, extra: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """All-gather every rank's ``(steps, 3)`` step records (padded to the longest) and one extra scalar.

    Returns ``(records of shape (world, steps, 3), extras of shape (world,))``. Uses only the strategy's
    public ``all_gather``, so it works under any Lightning strategy.
    """
    gathered, headers = balancing_gather(StrategyCollectives(strategy), records, header=[extra], align="pad")
    assert gathered is not None  # "pad" always returns records
    return gathered, headers[:, 1]


class StragglerMonitor(Callback):
    """Per-epoch straggler level and idle fraction of a stock DDP run (equal batches, unweighted mean).

    Attributes:
        history: one dict per epoch: ``epoch``, ``batch_sizes``, ``compute_time`` (median per rank),
            ``straggler_level``, ``idle_fraction``.
    """

    #: registers the weighted DDP comm hook (one per model: see ``check_one_weighting``)
    registers_weighted_hook = True

    def __init__(self, log_metrics: bool = True) -> None:
        self.log_metrics = check_bool("log_metrics", log_metrics, hint="False logs no metrics")
        self.timer = StepTimer()
        self.history: list[dict[str, Any]] = []
        self._state: WeightedAllreduceState | None = None

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        return self.history

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_one_weighting(trainer.callbacks, self)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_process_group_at_exit()  # beside the stock "ddp": gloo's threads may abort the exit otherwise
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and self._state is None:
            self._state = WeightedAllreduceState(1.0 / trainer.world_size, timer=self.timer)
            model.register_comm_hook(self._state, weighted_allreduce_hook)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.pop_records()
        self.timer.reset_data_clock()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        from lightning.pytorch.utilities.data import extract_batch_size

        self.timer.start_step(int(extract_batch_size(batch)))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.mark_backward_end()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.timer.end_step()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        records = np.array([r.as_tuple() for r in self.timer.pop_records()], dtype=np.float64).reshape(-1, 3)
        gathered, _ = gather_records(trainer.strategy, records)
        medians, sizes = [], []
        for r in range(gathered.shape[0]):
            b, t = gathered[r, :, 0], gathered[r, :, 1]
            ok = b > 0
            medians.append(float(np.median(t[ok])) if ok.any() else 0.0)
            sizes.append(int(np.median(b[ok])) if ok.any() else 0)
        entry = {
            "epoch": trainer.current_epoch,
            "batch_sizes": sizes,
            "compute_time": medians,
            "straggler_level": straggler_level(medians),
            "idle_fraction": idle_fraction(medians),
        }
        self.history.append(entry)
        if self.log_metrics:
            pl_module.log_dict(
                {"hetero/straggler_level": entry["straggler_level"], "hetero/idle_fraction": entry["idle_fraction"]},
                sync_dist=True,
            )
