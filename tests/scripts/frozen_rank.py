"""One rank of a 2-rank Lightning job (gloo, CPU) in which one rank freezes itself (SIGSTOP) mid-epoch.

Launched once per rank by ``tests/test_aggregation_faults.py`` with Lightning's manual-launch variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``), so the test knows every rank's
process. The frozen rank writes ``frozen`` (the time it froze) into ``--out`` first.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning.pytorch as pl  # noqa: E402

from hetero_plugins.strategies import HeteroDDPStrategy  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, freeze_rank: int, freeze_step: int, out: str) -> None:
        super().__init__()
        self.freeze_rank, self.freeze_step, self.out = freeze_rank, freeze_step, out
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.freeze_rank and batch_idx == self.freeze_step:
            with open(os.path.join(self.out, "frozen"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(640, 8, generator=g)
        return DataLoader(TensorDataset(x, torch.randint(0, 3, (640,), generator=g)), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--freeze-rank", type=int, default=0)
    parser.add_argument("--freeze-step", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = HeteroDDPStrategy(aggregation=args.mode, timeout=timedelta(seconds=args.timeout),
                                 process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=2, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Net(args.freeze_rank, args.freeze_step, args.out))


if __name__ == "__main__":
    main()
