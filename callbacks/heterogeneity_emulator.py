"""``HeterogeneityEmulator``: make any machine behave like a heterogeneous cluster.

Before backward, each rank sleeps ``cost_per_sample * local_batch / speed`` seconds (times a stall factor;
per micro-batch under the micro-batched aggregation modes),
so a rank at speed 0.25 takes four times as long per sample as one at speed 1. Sleeping uses no CPU, so four
emulated ranks run faithfully on a 2-core machine as long as the real compute is small next to the delays.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from hetero_plugins.collectives import release_process_group_at_exit
from hetero_plugins.emulation import EmulationModel, RandomStalls, Stall

__all__ = ["HeterogeneityEmulator"]


class HeterogeneityEmulator(Callback):
    """Emulates per-rank speeds, speed changes at given epochs, and transient stalls.

    Args:
        speeds: relative speed of each rank, one per rank (e.g. ``[1, 1, 0.5, 0.25]``).
        cost_per_sample: seconds per sample at speed 1.
        schedule: ``{epoch: speeds}`` or ``{epoch: {rank: speed}}``; each change holds from that epoch on.
        stalls: :class:`~hetero_plugins.emulation.Stall` entries and/or a
            :class:`~hetero_plugins.emulation.RandomStalls`.
        overhead: fixed seconds added to every step.

    Example::

        >>> emu = HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002, schedule={3: {0: 0.3}})
        >>> emu.model.speed(0, 3)
        0.3
    """

    def __init__(
        self,
        speeds: Sequence[float],
        cost_per_sample: float,
        schedule: Mapping[int, Sequence[float] | Mapping[int, float]] | None = None,
        stalls: Sequence[Stall | RandomStalls] | RandomStalls | None = None,
        overhead: float = 0.0,
    ) -> None:
        self.model = EmulationModel(speeds, cost_per_sample, schedule=schedule, stalls=stalls, overhead=overhead)
        self._batch = 0
        self._step = 0
        self.slept = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size != self.model.world_size:
            raise ValueError(
                f"HeterogeneityEmulator got {self.model.world_size} `speeds` ({self.model.speeds}) for "
                f"{trainer.world_size} ranks. HINT: give exactly one speed per rank."
            )
        release_process_group_at_exit()  # beside the stock "ddp": gloo's threads may abort the exit otherwise

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = int(extract_batch_size(batch))
        self._step = batch_idx

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        # Micro-batched aggregation modes back-propagate each micro-batch; the strategy says how big it is.
        micro = getattr(trainer.strategy, "micro_batch_samples", None)
        samples = self._batch if micro is None else int(micro)
        if samples <= 0:
            return
        delay = self.model.delay(trainer.global_rank, trainer.current_epoch, self._step, samples)
        if delay > 0:
            time.sleep(delay)
            self.slept += delay
