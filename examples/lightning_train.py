"""Train the digits CNN with HeteroDDPStrategy, the way a user runs a Lightning script.

    python examples/lightning_train.py --devices 4 --speeds 1,1,0.5,0.25 --epochs 5

Lightning starts the other ranks itself (``"hetero_ddp"`` re-runs this script per rank, like ``"ddp"``).
``--callback`` uses the stock ``"ddp"`` strategy with the ``BatchBalancer`` callback instead. After training,
``Trainer.predict`` runs on the validation set with per-rank batch sizes and returns every rank's predictions
in dataset order. ``--aggregation wbsp`` (or ``deadline``, ``pseudo_sync``, ``local_sgd``) picks how each
step's gradients are combined when some rank stalls (see the README). ``--policy auto --cluster cluster.json``
plans with the learned scheduler, told by a cluster description which jobs share which GPU and which GPUs
are idle (see docs/scheduler.md); under torchrun the run resumes after a relocation restart.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl

from hetero_plugins.strategies import HeteroDDPStrategy
from hetero_plugins.apps.digits import DigitsCNN, digits_datasets
from hetero_plugins.callbacks import BatchBalancer, HeterogeneityEmulator
from hetero_plugins.scheduler.relocation import resume_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--speeds", default="1,0.25", help="emulated speed per rank")
    parser.add_argument("--cost-per-sample", type=float, default=0.002)
    parser.add_argument("--callback", action="store_true", help="stock 'ddp' + BatchBalancer instead of 'hetero_ddp'")
    parser.add_argument("--aggregation", default="weighted",
                        choices=["weighted", "deadline", "wbsp", "pseudo_sync", "local_sgd"],
                        help="how each step's gradients are combined (strategy only)")
    parser.add_argument("--policy", default="equal_finish", help="allocator: equal_finish, lbb, dqn, auto, ...")
    parser.add_argument("--cluster", default=None, help="cluster description JSON (re-read every epoch)")
    parser.add_argument("--out", default=None, help="rank 0 writes plan history, weights and predictions here (.pt)")
    args = parser.parse_args()

    speeds = [float(s) for s in args.speeds.split(",")]
    callbacks: list = [HeterogeneityEmulator(speeds, cost_per_sample=args.cost_per_sample)]
    if args.callback:
        callbacks.append(BatchBalancer(policy=args.policy, cluster=args.cluster))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices,
        strategy="ddp" if args.callback else HeteroDDPStrategy(aggregation=args.aggregation, policy=args.policy,
                                                               cluster=args.cluster),
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    model = DigitsCNN(batch_size=32)
    trainer.fit(model, ckpt_path=resume_checkpoint(os.path.join(trainer.default_root_dir, "hetero_restart.json")))
    _, val = digits_datasets()
    predictions = trainer.predict(model, dataloaders=DataLoader(val, batch_size=32))
    balancer = next(cb for cb in trainer.callbacks if isinstance(cb, BatchBalancer))
    if trainer.is_global_zero:
        print(json.dumps({"batch_plan": balancer.batch_plan, "epochs": len(balancer.plan_history)}))
        if args.out:
            torch.save({"plan_history": balancer.plan_history, "state_dict": model.state_dict(),
                        "predictions": torch.cat(predictions)}, args.out)


if __name__ == "__main__":
    main()
