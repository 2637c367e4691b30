"""Train the digits CNN with HeteroDDPStrategy, the way a user runs a Lightning script.

    python examples/lightning_train.py --devices 4 --speeds 1,1,0.5,0.25 --epochs 5
    python examples/lightning_train.py --accelerator auto --devices auto --epochs 5

It runs where you are: ``--accelerator auto`` (the default) trains on the GPUs when there are any and on the
CPU otherwise; ``--devices auto`` (the default) uses every GPU, or on the CPU one process per emulated speed.
``--speeds`` emulates a mixed cluster by slowing ranks down (``HeterogeneityEmulator``); by default on the CPU
(speeds 1 and 0.25), not on GPUs, whose own speeds the balancer measures (``--speeds none`` turns it off,
a list turns it on anywhere). Lightning starts the other ranks itself (``"hetero_ddp"`` re-runs this script
per rank, like ``"ddp"``). ``--callback`` uses the stock ``"ddp"`` strategy with the ``BatchBalancer``
callback instead. After training, ``Trainer.predict`` runs on the validation set with per-rank batch sizes
and returns every rank's predictions in dataset order. ``--aggregation wbsp`` (or ``deadline``,
``pseudo_sync``, ``local_sgd``) picks how each step's gradients are combined when some rank stalls (see the
README). ``--policy auto --cluster cluster.json`` plans with the learned scheduler, told by a cluster
description which jobs share which GPU and which GPUs are idle (see docs/scheduler.md); under torchrun the
run resumes after a relocation restart. The run keeps Lightning's default log and checkpoint in
``lightning_logs/version_N``: ``hetero-plugins report`` draws them.
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
    parser.add_argument("--accelerator", default="auto", choices=["auto", "gpu", "cpu"],
                        help="auto: the GPUs when there are any, else the CPU (default)")
    parser.add_argument("--devices", default="auto",
                        help="processes: a number, or auto (every GPU; on the CPU one per emulated speed)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    parser.add_argument("--speeds", default="auto",
                        help="emulated speed per rank, e.g. 1,0.25; auto: 1,0.25 on the CPU and none on GPUs; none")
    parser.add_argument("--cost-per-sample", type=float, default=0.002)
    parser.add_argument("--callback", action="store_true", help="stock 'ddp' + BatchBalancer instead of 'hetero_ddp'")
    parser.add_argument("--aggregation", default="weighted",
                        choices=["weighted", "deadline", "wbsp", "pseudo_sync", "local_sgd"],
                        help="how each step's gradients are combined (strategy only)")
    parser.add_argument("--policy", default="auto",
                        help="allocator: auto (the library's default), equal_finish, lbb, dqn, proportional, static")
    parser.add_argument("--cluster", default=None, help="cluster description JSON (re-read every epoch)")
    parser.add_argument("--out", default=None, help="rank 0 writes plan history, weights and predictions here (.pt)")
    args = parser.parse_args()
    if args.devices != "auto" and (not args.devices.isdigit() or int(args.devices) < 1):
        parser.error(f"--devices must be a number >= 1 or auto, got {args.devices!r}")
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")

    # Where to run: the GPUs when there are any, else the CPU (README, "On GPUs").
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.speeds == "none" or (args.speeds == "auto" and accelerator == "gpu"):
        speeds = None  # real GPUs: the balancer measures their own speeds
    elif args.speeds == "auto":
        speeds = [1.0, 0.25]
    else:
        try:
            speeds = [float(s) for s in args.speeds.split(",")]
        except ValueError:
            parser.error(f"--speeds must be auto, none or comma-separated numbers, got {args.speeds!r}")
        if min(speeds) <= 0:
            parser.error(f"--speeds must be positive (1: full speed, 0.25: a quarter), got {args.speeds!r}")
    devices = args.devices
    if devices == "auto":
        devices = torch.cuda.device_count() if accelerator == "gpu" else len(speeds or [1, 1])
    devices = int(devices)
    if speeds is not None and len(speeds) != devices:
        parser.error(f"--speeds has {len(speeds)} entries for {devices} devices. HINT: give one speed per device, "
                     "or --speeds none.")

    callbacks: list = [] if speeds is None else [HeterogeneityEmulator(speeds, cost_per_sample=args.cost_per_sample)]
    try:  # the options are checked here, before any rank starts
        if args.callback:
            callbacks.append(BatchBalancer(policy=args.policy, cluster=args.cluster))
        strategy = "ddp" if args.callback else HeteroDDPStrategy(aggregation=args.aggregation, policy=args.policy,
                                                                 cluster=args.cluster)
    except ValueError as err:
        parser.error(str(err))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_epochs=args.epochs,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    model = DigitsCNN(batch_size=32)
    trainer.fit(model, ckpt_path=resume_checkpoint(os.path.join(trainer.default_root_dir, "hetero_restart.json")))
    _, val = digits_datasets()
    predictions = trainer.predict(model, dataloaders=DataLoader(val, batch_size=32))
    balancer = next(cb for cb in trainer.callbacks if isinstance(cb, BatchBalancer))
    log_dir = trainer.log_dir  # a collective: every rank asks
    if trainer.is_global_zero:
        print(json.dumps({"accelerator": accelerator, "devices": devices, "speeds": speeds,
                          "batch_plan": balancer.batch_plan, "epochs": len(balancer.plan_history),
                          "log_dir": log_dir}))
        print(f"what the balancer did: hetero-plugins report {log_dir}")
        if args.out:
            state = {k: v.cpu() for k, v in model.state_dict().items()}
            torch.save({"plan_history": balancer.plan_history, "state_dict": state,
                        "predictions": torch.cat(predictions).cpu()}, args.out)


if __name__ == "__main__":
    main()
