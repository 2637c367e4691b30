"""Small Lightning jobs the integration tests run on 2 spawned CPU ranks (importable by the children)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins.apps.digits import digits_datasets


class DigitsMLP(pl.LightningModule):
    """float64 MLP on digits, plain SGD with momentum: deterministic enough to replay exactly."""

    def __init__(self, batch_size: int = 16, lr: float = 0.1, fail_on_rank: int | None = None, fail_at_step: int = 3,
                 batchnorm: bool = False, die: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)]
        if batchnorm:
            layers.insert(2, nn.BatchNorm1d(32))
        self.net = nn.Sequential(*layers).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.hparams.fail_on_rank == self.global_rank and self.current_epoch == 1 and batch_idx == self.hparams.fail_at_step:
            if self.hparams.die:
                os._exit(13)  # the process dies without a Python exception, e.g. killed by the OOM killer
            raise RuntimeError(f"injected failure on rank {self.global_rank}")
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).double().mean(), sync_dist=True, batch_size=len(y))
        self.log("val_batch", float(len(y)), reduce_fx="max", sync_dist=False, batch_size=1)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(digits_datasets(dtype=torch.float64)[0], batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(digits_datasets(dtype=torch.float64)[1], batch_size=self.hparams.batch_size)


class IndexedDigitsMLP(DigitsMLP):
    """DigitsMLP whose batches carry the sample indices; ``seen[epoch]`` lists the indices this rank trained on
    (what the aggregation modes must cover exactly once per epoch)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self) -> DataLoader:
        x, y = digits_datasets(dtype=torch.float64)[0].tensors
        return DataLoader(TensorDataset(x, y, torch.arange(len(y))), batch_size=self.hparams.batch_size, shuffle=True)


class SlowCollate:
    """Collates a batch and, on global rank ``rank``, first waits ``seconds``: an input pipeline that stalls
    one rank (picklable for ``spawn``)."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def __call__(self, items: list[Any]) -> Any:
        import time

        from torch.utils.data import default_collate

        if torch.distributed.is_initialized() and torch.distributed.get_rank() == self.rank:
            time.sleep(self.seconds)
        return default_collate(items)


class SlowInputDigitsMLP(DigitsMLP):
    """:class:`DigitsMLP` whose training batches reach global rank 1 ``wait`` seconds late."""

    def __init__(self, wait: float = 0.03, **kw: Any) -> None:
        super().__init__(**kw)
        self.wait = wait

    def train_dataloader(self) -> DataLoader:
        return DataLoader(digits_datasets(dtype=torch.float64)[0], batch_size=self.hparams.batch_size, shuffle=True,
                          collate_fn=SlowCollate(1, self.wait))


class OwnWeights(Callback):
    """Each rank of a stock DDP run started from the fork server gets its own copy of the weights, as a
    ``torchrun`` launch gives it (there, Lightning leaves one copy shared by all ranks; nothing else changes)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from hetero_plugins.callbacks.shared_weights import unshare_module_memory

        unshare_module_memory(pl_module)


class Report(Callback):
    """Every rank writes what it saw: its plan, its history, its batch sizes per epoch, the hook's calls."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.batches: dict[int, list[int]] = {}
        self.val_batches: dict[int, list[int]] = {}  # validation inside fit, per epoch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Weights in memory shared with other processes (a fork server's ranks get them so; each must own a copy).
        self.shared_weights = sum(int(t.is_shared()) for t in pl_module.parameters())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches.setdefault(trainer.current_epoch, []).append(len(batch[1]))

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if trainer.state.fn == "fit":
            self.val_batches.setdefault(trainer.current_epoch, []).append(len(batch[1]))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        balancer = next((cb for cb in trainer.callbacks if type(cb).__name__ == "BatchBalancer"), None)
        hook = getattr(balancer, "hook_state", None)
        report = {
            "rank": trainer.global_rank,
            "batch_plan": balancer.batch_plan if balancer else None,
            "plan_history": balancer.plan_history if balancer else None,
            "batches": self.batches,
            "val_batches": self.val_batches,
            "hook_calls": hook.calls if hook is not None else 0,
            "strategy_plan": getattr(trainer.strategy, "batch_plan", None),
            "train_batches": trainer.num_training_batches,
            "seen": getattr(pl_module, "seen", None),
            "communication_bytes": getattr(trainer.strategy, "communication_bytes", None),
            "communication_rounds": getattr(trainer.strategy, "communication_rounds", None),
            "carried_samples": getattr(trainer.strategy, "carried_samples", None),
            "stolen_samples": getattr(trainer.strategy, "stolen_samples", None),
            "state": {k: v.tolist() for k, v in pl_module.state_dict().items()},
            "shared_weights": getattr(self, "shared_weights", None),
        }
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(report, f)


def read_reports(out_dir: str, world_size: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def video_arrives_on_rank_1(epoch: int) -> dict[str, Any]:
    """A cluster description (``cluster=`` of the balancer): from epoch 1 a video job shares rank 1's GPU and
    an idle v100 is free."""
    if epoch == 0:
        return {"ranks": [{"device": "v100", "corunner": None}, {"device": "v100", "corunner": None}]}
    return {"ranks": [{"device": "v100", "corunner": None}, {"device": "v100", "corunner": "video"}],
            "free_slots": [{"device": "v100", "corunner": None}]}
