"""A small real workload: a CNN on scikit-learn's bundled digits (1,797 8x8 images; no download)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins.collectives import release_process_group_at_exit
from hetero_plugins.progress import Progress, is_quiet

__all__ = ["DigitsCNN", "RunRecorder", "digits_datasets", "val_accuracy"]


def digits_datasets(seed: int = 0, val_fraction: float = 0.2, dtype: torch.dtype = torch.float32) -> tuple[TensorDataset, TensorDataset]:
    """Train/validation split of the digits data, pixels scaled to [0, 1], shape (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    n_val = int(round(val_fraction * len(x)))
    val, train = order[:n_val], order[n_val:]
    xt = torch.tensor(x / 16.0, dtype=dtype).reshape(-1, 1, 8, 8)
    yt = torch.tensor(y, dtype=torch.long)
    return TensorDataset(xt[train], yt[train]), TensorDataset(xt[val], yt[val])


class DigitsCNN(pl.LightningModule):
    """Two conv layers and two linear layers; SGD with momentum and a cosine schedule. Logs ``val_acc``/``val_loss``.

    ``dtype="float64"`` runs the network and the data in double precision: two runs that compute the same
    updates in a different order (stock DDP and HeteroDDPStrategy sum each step's gradients by rank) then agree
    to rounding, where float32's rounding grows over epochs of SGD with momentum (``make bench``)."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, batch_size: int = 32, seed: int = 0,
                 dtype: str = "float32") -> None:
        super().__init__()
        if dtype not in ("float32", "float64"):
            raise ValueError(f"`dtype` must be 'float32' or 'float64', got {dtype!r}. HINT: 'float64' gives runs "
                             "whose updates can be compared to rounding (e.g. stock DDP against HeteroDDPStrategy).")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
        )
        self.loss = nn.CrossEntropyLoss()
        self.to(getattr(torch, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", self.loss(logits, y), sync_dist=True, batch_size=len(y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, batch_size=len(y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        epochs = self.trainer.max_epochs if self._trainer is not None and self.trainer.max_epochs else 10
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, epochs))}

    def train_dataloader(self) -> DataLoader:
        train, _ = digits_datasets(self.hparams.seed, dtype=getattr(torch, self.hparams.dtype))
        return DataLoader(train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        _, val = digits_datasets(self.hparams.seed, dtype=getattr(torch, self.hparams.dtype))
        return DataLoader(val, batch_size=self.hparams.batch_size)


def val_accuracy(state_dict: dict[str, torch.Tensor], dtype: str = "float32", seed: int = 0) -> float:
    """Accuracy of a :class:`DigitsCNN` with these weights on the whole validation split, each sample once (the
    figure in-run validation can only approximate: stock DDP's sampler pads the last batch with repeated samples)."""
    model = DigitsCNN(seed=seed, dtype=dtype)
    model.load_state_dict(state_dict)
    _, val = digits_datasets(seed, dtype=getattr(torch, dtype))
    with torch.no_grad():
        return float((model(val.tensors[0]).argmax(1) == val.tensors[1]).double().mean())


class RunRecorder(Callback):
    """Rank 0 records timings, metrics and the balancer's history, prints one progress line per epoch and
    writes a JSON file (after every epoch, so a crash leaves what was done). On a terminal, rank 0 also draws a
    bar over the run's steps with their rate and the time left (:mod:`hetero_plugins.progress`); with
    ``HETERO_PLUGINS_QUIET=1`` (``hetero-plugins --quiet``) neither bar nor lines are printed.

    Epoch time is the training part of the epoch (first batch start to last batch end, as rank 0 sees it,
    which under synchronous training is every rank's); validation time is excluded.

    Args:
        path: JSON file to write.
        label: prefix of the progress lines and label of the bar; ``None`` prints nothing.
        weights: where rank 0 saves the module's final ``state_dict`` (``torch.save``) at the fit's end; ``None``:
            nowhere.
    """

    def __init__(self, path: str | os.PathLike, label: str | None = None,
                 weights: str | os.PathLike | None = None) -> None:
        self.path = Path(path)
        self.label = label
        self.weights = None if weights is None else Path(weights)
        self.epochs: list[dict[str, Any]] = []
        self._t0: float | None = None
        self._last: float | None = None
        self._start = time.perf_counter()
        self._step_ends: list[float] = []
        self._bar: Progress | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bar": None}  # the bar belongs to the process that draws it

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The demo's stock-DDP baseline has none of the project's callbacks, which release the process group
        # before the interpreter's teardown; without that, gloo's threads occasionally abort a spawned rank at
        # exit ("terminate called without an active exception") after training finished, failing the run.
        release_process_group_at_exit()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is None and self.label is not None and trainer.is_global_zero and not is_quiet():
            per_epoch = trainer.num_training_batches
            epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
            total = epochs * per_epoch if epochs and isinstance(per_epoch, int) else None
            self._bar = Progress(total=total, desc=self.label, unit="step")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self._t0 = time.perf_counter()
            self._step_ends = [self._t0]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._last = time.perf_counter()
        self._step_ends.append(self._last)
        if self._bar is not None:
            self._bar.update(1)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t0 is None or self._last is None:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        plan = getattr(trainer.strategy, "batch_plan", None)
        entry = {"epoch": trainer.current_epoch, "train_time": self._last - self._t0,
                 "wall_time": time.perf_counter() - self._start, "batch_sizes": plan,
                 "step_times": [b - a for a, b in zip(self._step_ends, self._step_ends[1:])],
                 "communication_bytes": getattr(trainer.strategy, "communication_bytes", None), **metrics}
        self.epochs.append(entry)
        if trainer.is_global_zero:
            if self.label is not None and not is_quiet():
                acc = f" val_acc {metrics['val_acc']:.3f}" if "val_acc" in metrics else ""
                sizes = f" batch sizes {plan}" if plan else ""
                line = (f"[{self.label}] epoch {trainer.current_epoch + 1}/{trainer.max_epochs} "
                        f"train {entry['train_time']:.2f}s{acc}{sizes}")
                if self._bar is not None:
                    self._bar.set_postfix(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}{acc}")
                    self._bar.write(line)
                else:
                    print(line, flush=True)
            self._write(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if trainer.is_global_zero:
            self._write(trainer)
            if self.weights is not None:
                torch.save({k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}, self.weights)

    def _write(self, trainer: pl.Trainer) -> None:
        history = getattr(trainer.strategy, "plan_history", None)
        if history is None:
            for cb in trainer.callbacks:
                if hasattr(cb, "plan_history"):
                    history = cb.plan_history
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"epochs": self.epochs, "plan_history": history or []}, indent=1))
