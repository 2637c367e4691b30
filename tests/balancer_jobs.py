"""Lightning jobs for the resume, iterable-dataset, custom-sampler and two-node tests (importable by the children).

Every rank appends each training step's sample indices to ``<out_dir>/steps_rank<r>.jsonl`` as the step runs,
so what a rank trained on survives the rank being killed.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins.apps.digits import digits_datasets
from tests.lightning_jobs import DigitsMLP

#: Training samples of these jobs: 15 steps of 2 x 16, 10 steps of 3 x 16.
N = 480


def indexed_digits(n: int = N) -> TensorDataset:
    x, y = digits_datasets(dtype=torch.float64)[0].tensors
    return TensorDataset(x[:n], y[:n], torch.arange(n))


class IterableDigits(IterableDataset):
    """The first ``n`` digits as an ``IterableDataset`` (no ``len``): each rank yields every world-size-th one."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        data = indexed_digits(self.n)
        dist = torch.distributed
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        for i in range(rank, self.n, world):
            yield data[i]


class StepLogMLP(DigitsMLP):
    """``DigitsMLP`` on :func:`indexed_digits` (or ``loader="weighted"`` / ``"iterable"``), logging each step."""

    def __init__(self, out_dir: str, loader: str = "shuffle", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.loader = loader

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        with open(os.path.join(self.out_dir, f"steps_rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": self.current_epoch, "step": batch_idx, "idx": idx.tolist()}) + "\n")
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self) -> DataLoader:
        b = self.hparams.batch_size
        if self.loader == "iterable":
            return DataLoader(IterableDigits(), batch_size=b)
        if self.loader == "weighted":
            return DataLoader(indexed_digits(), batch_size=b, sampler=WeightedRandomSampler(torch.ones(N), N))
        return DataLoader(indexed_digits(), batch_size=b, shuffle=True)


class KillRank(Callback):
    """``kill -9`` of rank ``rank`` after step ``step`` of epoch ``epoch``."""

    def __init__(self, rank: int, epoch: int, step: int) -> None:
        self.rank, self.epoch, self.step = rank, epoch, step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (trainer.global_rank, trainer.current_epoch, batch_idx) == (self.rank, self.epoch, self.step):
            os.kill(os.getpid(), signal.SIGKILL)


class ModelProbe(Callback):
    """Every rank writes its planner's time-model lines and plan at the start of training."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        planner = next(cb for cb in trainer.callbacks if type(cb).__name__ == "BatchBalancer").planner
        lines = [None if p is None else [p.intercept, p.slope] for p in planner.model_params()]
        with open(os.path.join(self.out_dir, f"probe_rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"lines": lines, "plan": planner.plan}, f)


def step_logs(out_dir: str, world_size: int) -> list[list[dict[str, Any]]]:
    """Each rank's logged steps, in order."""
    out = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"steps_rank{r}.jsonl")) as f:
            out.append([json.loads(line) for line in f])
    return out


def epoch_indices(logs: list[list[dict[str, Any]]], epoch: int, steps: range | None = None) -> list[int]:
    """All ranks' sample indices of ``epoch`` (of the steps in ``steps`` only, if given)."""
    return [i for rank in logs for s in rank if s["epoch"] == epoch and (steps is None or s["step"] in steps)
            for i in s["idx"]]


def plan_at(entry: dict[str, Any], step: int) -> list[int]:
    """The plan a history entry says step ``step`` of its epoch ran."""
    plan = entry["batch_sizes"]
    for change in entry.get("plan_changes", []):
        if change["step"] <= step:
            plan = change["batch_sizes"]
    return plan
