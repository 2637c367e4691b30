"""Run under ``horovodrun -np 2 --gloo``: ``Trainer(strategy="hetero_horovod")`` checks on every rank.

- the strategy detects Horovod (ranks/world size from hvd, no LOCAL_RANK), Lightning injects the sampler;
- float64 exactness: after every optimizer step the parameters equal one process stepping (SGD with
  momentum) on the union of that step's samples across ranks, to 1e-9, through the plan changes that
  emulated speeds (1, 0.25) cause; also with ``accumulate_grad_batches=2``;
- every training sample exactly once per epoch; ``batch_plan`` identical on all ranks;
- ``hetero/*`` metrics logged; the checkpoint holds the planner, and a resumed run restores the plan.
Rank 0 writes a JSON summary to argv[1]; argv[2] is a scratch directory for checkpoints.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.strategies import HeteroHorovodStrategy

TOL = 1e-9
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Net(pl.LightningModule):
    def __init__(self, data: TensorDataset, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
        self.data, self.batch_size = data, batch_size
        self.loss = torch.nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class UnionReference(Callback):
    """A one-process replica stepping on the union of each optimizer step's samples across ranks."""

    def __init__(self, net: torch.nn.Module, accumulate: int) -> None:
        self.ref = copy.deepcopy(net)
        self.opt = torch.optim.SGD(self.ref.parameters(), lr=0.1, momentum=0.9)
        self.accumulate = accumulate
        self.buf: list = []
        self.seen: dict[int, list[int]] = {}
        self.worst = 0.0
        self.checked = 0
        self.plans: list = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.seen[trainer.current_epoch] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x, y, i = batch
        self.seen[trainer.current_epoch] += i.tolist()
        self.buf.append((torch.cat(hvd.allgather_object(x, name="ux")), torch.cat(hvd.allgather_object(y, name="uy"))))
        last = batch_idx + 1 == trainer.num_training_batches
        if (batch_idx + 1) % self.accumulate and not last:
            return
        self.opt.zero_grad()
        for bx, by in self.buf:
            (torch.nn.functional.cross_entropy(self.ref(bx), by) / self.accumulate).backward()
        self.opt.step()
        self.buf = []
        d = max((p - q).abs().max().item() for p, q in zip(pl_module.net.parameters(), self.ref.parameters()))
        self.worst = max(self.worst, d)
        self.checked += 1
        assert d < TOL, f"epoch {trainer.current_epoch} batch {batch_idx}: params differ from the union step by {d}"

    def on_train_epoch_end(self, trainer, pl_module):
        everything = sorted(sum(hvd.allgather_object(self.seen[trainer.current_epoch], name="seen"), []))
        n = len(pl_module.data)
        assert everything == list(range(n)), f"epoch {trainer.current_epoch}: samples not exactly once ({len(everything)}/{n})"
        plans = hvd.allgather_object(trainer.strategy.batch_plan, name="plans")
        assert all(p == plans[0] for p in plans), f"batch_plan differs across ranks: {plans}"
        self.plans.append(plans[0])


def fit(data, epochs, accumulate, ckpt_dir=None, resume=None):
    model = Net(data, batch_size=8)
    ref = UnionReference(model.net, accumulate)
    emu = HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.003)
    callbacks = [ref, emu]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True))
    trainer = pl.Trainer(
        strategy="hetero_horovod", accelerator="cpu", devices=1, max_epochs=epochs, callbacks=callbacks,
        accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(ckpt_dir), num_sanity_val_steps=0,
    )
    assert isinstance(trainer.strategy, HeteroHorovodStrategy), type(trainer.strategy)
    if resume:
        # Resuming restores model/optimizer; the reference must start from the same point.
        state = torch.load(resume, weights_only=False)
        model.load_state_dict(state["state_dict"])
        ref.ref.load_state_dict(model.net.state_dict())
        ref.opt.load_state_dict(state["optimizer_states"][0])
    trainer.fit(model, ckpt_path=resume)
    return trainer, ref


def main(out_path: str, scratch: str) -> None:
    torch.set_num_threads(1)
    assert "LOCAL_RANK" not in os.environ
    train, _ = digits_datasets(seed=0, dtype=torch.float64)
    n = 200
    x = torch.stack([train[i][0].reshape(-1) for i in range(n)])
    y = torch.stack([train[i][1] for i in range(n)])
    data = TensorDataset(x, y, torch.arange(n))

    ckpt_dir = os.path.join(scratch, "ckpt")
    trainer, ref = fit(data, epochs=4, accumulate=1, ckpt_dir=ckpt_dir)
    strategy = trainer.strategy
    assert strategy.world_size == hvd.size() == 2 and strategy.global_rank == hvd.rank()
    history = strategy.plan_history
    assert history[0]["batch_sizes"] == [8, 8], history[0]  # the first epoch starts on an equal split...
    changes = history[0]["plan_changes"]  # ...and moves samples to the fast rank within the epoch
    assert changes and changes[0]["step"] <= 10 and changes[0]["batch_sizes"][0] > 8, changes
    assert ref.plans[-1][0] > ref.plans[-1][1], f"the fast rank 0 should get more samples: {ref.plans}"
    assert "hetero/batch_size/rank_0" in trainer.callback_metrics, sorted(trainer.callback_metrics)
    last = os.path.join(ckpt_dir, "last.ckpt")
    ckpt = torch.load(last, weights_only=False)
    planner_state = ckpt["callbacks"]["BatchBalancer"]["planner"]
    assert planner_state["plan"] == strategy.batch_plan, (planner_state["plan"], strategy.batch_plan)

    # resume: the restored plan drives epoch 4 (no re-learning from [8, 8])
    trainer2, ref2 = fit(data, epochs=5, accumulate=1, resume=last)
    assert len(trainer2.strategy.plan_history) == 5, len(trainer2.strategy.plan_history)
    assert trainer2.strategy.plan_history[4]["batch_sizes"] == strategy.batch_plan

    # gradient accumulation over two batches
    trainer3, ref3 = fit(data, epochs=2, accumulate=2)
    summary = {
        "plans": [h["batch_sizes"] for h in strategy.plan_history] + [strategy.batch_plan],
        "max_diff": ref.worst,
        "checked_steps": ref.checked,
        "resumed_plan": trainer2.strategy.plan_history[4]["batch_sizes"],
        "max_diff_resumed": ref2.worst,
        "max_diff_accumulation": ref3.worst,
        "checked_steps_accumulation": ref3.checked,
        "plan_history": strategy.plan_history,
        "ok": True,
    }
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
