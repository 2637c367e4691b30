"""Run under ``horovodrun -np 2 --gloo``: faults a plain Horovod script must end on, with an error that says why.

``python faults_check.py OUT_DIR PHASE``:

    mismatch   the ranks build ``hh.HeteroBatchSampler`` differently: num_samples 240 vs 200, then batch_size 8
               vs 6. ``set_epoch`` raises on every rank (each rank writes ``mismatch_rank{r}.json`` with the two
               messages); then a third sampler differs in ``seed`` and the error is left uncaught, so the job ends.
    freeze:M[:R[:sleep]]  aggregation mode M; rank R (default 0) stops itself (SIGSTOP; with ``sleep``, its
               training loop sleeps instead while Horovod's background thread runs on) at step 3 of epoch 0
               after writing ``frozen``; the others must end with an error naming rank R and the collective
               (``HETERO_PLUGINS_TIMEOUT`` and ``HOROVOD_GLOO_TIMEOUT_SECONDS`` bound the wait), which each
               writes whole to ``error_rank{r}.txt``.
    stall:K    a model with a parameter no step gives a gradient (an unused head), ``K`` ``plain`` (``"weighted"``),
               ``plain_sync`` (the same, calling ``optimizer.synchronize()`` before a clipped ``step()``) or
               ``lightning`` (``HeteroHorovodStrategy``): at step 2 rank 1 sleeps 60 s after its backward pass,
               before the optimizer step, after writing ``frozen`` (Horovod's background thread runs on, so Horovod
               never fails by itself). Horovod's ``synchronize()`` starts the unused parameter's all-reduce only
               then, and rank 0 must give up on it within ``HETERO_PLUGINS_TIMEOUT`` (``error_rank0.txt``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import hetero_plugins.horovod as hh


def mismatch(out: str) -> None:
    rank = hvd.rank()
    messages = {}
    for case, kwargs in (("num_samples", dict(num_samples=240 if rank == 0 else 200, batch_size=8)),
                         ("batch_size", dict(num_samples=240, batch_size=8 if rank == 0 else 6))):
        sampler = hh.HeteroBatchSampler(shuffle=True, seed=0, **kwargs)
        try:
            sampler.set_epoch(0)
            messages[case] = None
        except ValueError as err:
            messages[case] = str(err)
    with open(os.path.join(out, f"mismatch_rank{rank}.json"), "w") as f:
        json.dump(messages, f)
    hh.HeteroBatchSampler(240, batch_size=8, seed=rank).set_epoch(0)  # uncaught: the job ends on it


def freeze(out: str, mode: str, frozen: int = 0, sleep: bool = False) -> None:
    rank = hvd.rank()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 8, generator=g), torch.randint(0, 3, (320,), generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    sampler = hh.HeteroBatchSampler(len(data), batch_size=8, seed=0)
    loader = DataLoader(data, batch_sampler=sampler)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), batch_sampler=sampler,
                                  aggregation=mode, dataset=data)
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                if rank == frozen and epoch == 0 and step == 3:
                    with open(os.path.join(out, "frozen"), "w") as f:
                        f.write(repr(time.time()))
                    if sleep:
                        time.sleep(3600)
                    os.kill(os.getpid(), signal.SIGSTOP)
                opt.zero_grad()
                for x, y in opt.micro_batches(batch):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    except Exception as err:  # noqa: BLE001 - recorded whole: horovodrun may split the line it prints
        _record(out, rank, err)
        raise


def freeze_lightning(out: str, at_epoch_end: bool) -> None:
    """``Trainer(strategy=HeteroHorovodStrategy())``: rank 0 stops itself at step 3 of epoch 0 (in the gradient
    exchange's way), or at the end of epoch 0 (in the way of the strategy's own collectives: the balancer's)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from hetero_plugins.strategies import HeteroHorovodStrategy

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 8, generator=g), torch.randint(0, 3, (320,), generator=g))

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(data, batch_size=8, shuffle=True)

    def stop() -> None:
        with open(os.path.join(out, "frozen"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)

    class Freeze(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not at_epoch_end and trainer.global_rank == 0 and trainer.current_epoch == 0 and batch_idx == 3:
                stop()

        def on_train_epoch_end(self, trainer, pl_module):
            if at_epoch_end and trainer.global_rank == 0 and trainer.current_epoch == 0:
                stop()

    trainer = pl.Trainer(accelerator="cpu", strategy=HeteroHorovodStrategy(), max_epochs=2, callbacks=[Freeze()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    try:
        trainer.fit(Net())
    except Exception as err:  # noqa: BLE001 - recorded whole: horovodrun may split the line it prints
        _record(out, hvd.rank(), err)
        raise


class _WithUnusedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.unused = torch.nn.Linear(8, 3)  # in the optimizer, never in the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _stall(out: str) -> None:
    with open(os.path.join(out, "frozen"), "w") as f:
        f.write(repr(time.time()))
    time.sleep(60)


def _record(out: str, rank: int, err: BaseException) -> None:
    """``error_rank{rank}.txt``, renamed into place once whole: horovodrun may kill this rank mid-write."""
    path = os.path.join(out, f"error_rank{rank}.txt")
    with open(path + ".tmp", "w") as f:
        f.write(f"{type(err).__name__}: {err}")
    os.replace(path + ".tmp", path)


def stall(out: str, kind: str) -> None:
    rank = hvd.rank()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 8, generator=g), torch.randint(0, 3, (320,), generator=g))
    if kind in ("plain", "plain_sync"):
        model = _WithUnusedHead()
        sampler = hh.HeteroBatchSampler(len(data), batch_size=8, seed=0)
        opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), batch_sampler=sampler)
        try:
            sampler.set_epoch(0)
            for step, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                if rank == 1 and step == 2:
                    _stall(out)
                if kind == "plain_sync":  # Horovod's clipping pattern: synchronize, clip, step without it
                    opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
        except Exception as err:  # noqa: BLE001 - recorded whole: horovodrun may split the line it prints
            _record(out, rank, err)
            raise
        return
    import lightning.pytorch as pl

    from hetero_plugins.strategies import HeteroHorovodStrategy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _WithUnusedHead()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def on_after_backward(self) -> None:
            if self.global_rank == 1 and self.global_step == 2:
                _stall(out)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", strategy=HeteroHorovodStrategy(), max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    try:
        trainer.fit(Net(), DataLoader(data, batch_size=8))
    except Exception as err:  # noqa: BLE001 - recorded whole: horovodrun may split the line it prints
        _record(out, hvd.rank(), err)
        raise


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    out, phase = sys.argv[1], sys.argv[2]
    if phase == "mismatch":
        mismatch(out)
    elif phase.startswith("stall:"):
        stall(out, phase.split(":", 1)[1])
    elif phase.startswith("freeze:lightning"):
        freeze_lightning(out, at_epoch_end=phase.endswith("epoch_end"))
    else:
        _, mode, *frozen = phase.split(":")
        freeze(out, mode, int(frozen[0]) if frozen else 0, sleep=frozen[1:] == ["sleep"])
