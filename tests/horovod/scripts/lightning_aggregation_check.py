"""Run under ``horovodrun -np 2 --gloo``: ``HeteroHorovodStrategy(aggregation=...)`` checks on every rank.

For each explicit-exchange mode: every training sample exactly once per epoch (indices recorded in
``training_step``, which micro-batched modes call once per micro-batch); ``"wbsp"``: the fast rank steals
and the parameters equal one process stepping on each step's union (float64, 1e-9); ``"deadline"``: a
stalled rank carries samples; ``"local_sgd"``: ranks hold identical models after the epoch's average and
exchanged about 1/H of the steps; ``"pseudo_sync"``: trains. Rank 0 writes a JSON summary to argv[1].
"""

from __future__ import annotations

import copy
import json
import sys
import warnings

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.emulation import Stall
from hetero_plugins.balancing.partition import ddp_order, epoch_layout
from hetero_plugins.strategies import HeteroHorovodStrategy

TOL = 1e-9
BATCH = 8
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Net(pl.LightningModule):
    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
        self.data = data
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.seen.setdefault(self.current_epoch, []).extend(i.tolist())
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH, shuffle=True)


class UnionReplay(Callback):
    """A one-process replica stepping on each step's union (the plan-independent DDP step union)."""

    def __init__(self, net: torch.nn.Module, data: TensorDataset) -> None:
        self.ref = copy.deepcopy(net)
        self.opt = torch.optim.SGD(self.ref.parameters(), lr=0.1, momentum=0.9)
        self.data = data
        self.worst = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        n = len(self.data)
        layout = epoch_layout(n, [BATCH] * trainer.world_size)
        order = ddp_order(n, layout.padding, trainer.current_epoch, 0, True)
        gb = BATCH * trainer.world_size
        idx = order[batch_idx * gb : (batch_idx + 1) * gb].tolist()
        x, y, _ = self.data[idx]
        self.opt.zero_grad()
        torch.nn.functional.cross_entropy(self.ref(x), y).backward()
        self.opt.step()
        d = max((p - q).abs().max().item() for p, q in zip(pl_module.net.parameters(), self.ref.parameters()))
        self.worst = max(self.worst, d)
        assert d < TOL, f"epoch {trainer.current_epoch} step {batch_idx}: params differ from the union step by {d}"


def fit(data, aggregation, epochs, stalls=None, speeds=(1.0, 0.25), replay=False, replan_every=None):
    pl.seed_everything(0, verbose=False)
    model = Net(data)
    callbacks = [HeterogeneityEmulator(list(speeds), cost_per_sample=0.003, stalls=stalls)]
    ref = UnionReplay(model.net, data) if replay else None
    if ref is not None:
        callbacks.append(ref)
    strategy = HeteroHorovodStrategy(aggregation=aggregation, replan_every=replan_every)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model)
    n = len(data)
    for e in range(epochs):
        everything = sorted(sum(hvd.allgather_object(model.seen[e], name=f"seen{e}"), []))
        assert everything == list(range(n)), f"{aggregation}: epoch {e}: {len(everything)} processed of {n}"
    states = hvd.allgather_object({k: v.clone() for k, v in model.state_dict().items()}, name="states")
    identical = all(torch.equal(states[0][k], s[k]) for s in states for k in s)
    return trainer.strategy, ref, identical


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    train, _ = digits_datasets(seed=0, dtype=torch.float64)
    n = 200
    x = torch.stack([train[i][0].reshape(-1) for i in range(n)])
    y = torch.stack([train[i][1] for i in range(n)])
    data = TensorDataset(x, y, torch.arange(n))
    summary: dict = {}

    strategy, ref, identical = fit(data, "wbsp", epochs=2, replay=True)
    stolen = hvd.allgather_object(strategy.stolen_samples, name="stolen")
    assert stolen[0] > stolen[1], stolen
    summary["wbsp"] = {"stolen": stolen, "max_diff": ref.worst, "identical": identical}

    stall = Stall(rank=1, epoch=0, start_step=3, num_steps=6, slowdown=10.0)
    strategy, _, identical = fit(data, AggregationOptions("deadline", deadline_slack=0.2), epochs=2, stalls=[stall],
                                 speeds=(1.0, 1.0), replan_every=2)
    carried = hvd.allgather_object(strategy.carried_samples, name="carried")
    assert carried[1] > 0, carried
    summary["deadline"] = {"carried": carried, "identical": identical}

    strategy, _, identical = fit(data, AggregationOptions("local_sgd", local_steps=4), epochs=1)
    assert identical
    summary["local_sgd"] = {"rounds": strategy.communication_rounds, "bytes": strategy.communication_bytes,
                            "identical": identical}

    strategy, _, identical = fit(data, "pseudo_sync", epochs=1)
    summary["pseudo_sync"] = {"rounds": strategy.communication_rounds, "identical": identical}
    summary["ok"] = True
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
