"""GPU utilisation in plan_history and the logs is the epoch's mean, not one reading at its end."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from hetero_plugins.callbacks import BatchBalancer
from hetero_plugins.telemetry import UtilisationSampler


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
        return DataLoader(data, batch_size=8)


def test_the_history_holds_the_mean_of_the_readings_taken_during_the_epoch(tmp_path) -> None:
    readings = itertools.cycle([{"gpu_util": 20.0, "gpu_mem_used": 1e9}, {"gpu_util": 80.0, "gpu_mem_used": 3e9}])
    # what the balancer builds on a GPU, with readings injected in place of NVML
    balancer = BatchBalancer(utilisation=UtilisationSampler(read=lambda: next(readings), interval=60.0))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=[balancer], logger=CSVLogger(tmp_path),
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Tiny())
    for entry in balancer.plan_history:
        # start() and stop() each take one reading: 20 and 80, whose mean is 50 (a snapshot would say 20 or 80)
        assert entry["gpu_util"] == [50.0]
        assert entry["gpu_mem_used"] == [2e9]
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "hetero/gpu_util/rank_0" in rows.splitlines()[0]
