"""Train a small CNN on scikit-learn's digits with Horovod and per-rank batch sizes.

Run::

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py --speeds 1,0.25

It runs where you are: ``--accelerator auto`` (the default) puts local rank i on GPU i when there are GPUs
(``--devices 2,3`` picks others) and trains on the CPU otherwise; the number of ranks is horovodrun's
``-np``. ``--speeds`` emulates heterogeneous workers on any machine: before backward each rank sleeps
``cost_per_sample * local_batch / speed`` seconds (:class:`~hetero_plugins.emulation.EmulationModel`), so a
rank at 0.25 is four times slower. With ``hetero_plugins.horovod`` the planner gives the slow rank fewer
samples after the first epoch; ``--stock`` runs the baseline (``hvd.DistributedOptimizer`` with a
``DistributedSampler`` and equal batches) for comparison. ``--json-out`` makes rank 0 write the per-epoch
times, plans and validation accuracy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

try:
    import horovod.torch as hvd
except ImportError as err:  # make demo installs no Horovod; make horovod (or make test) builds it
    raise SystemExit(f"examples/horovod_train.py needs Horovod ({err}). HINT: run `make horovod` (it builds Horovod "
                     "0.28.1 against this torch once and caches the wheel), then launch with horovodrun.") from err

import hetero_plugins.horovod as hh
from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.emulation import EmulationModel


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerator", default="auto", choices=["auto", "gpu", "cpu"],
                   help="auto: local rank i on GPU i when there are GPUs, else the CPU (default)")
    p.add_argument("--devices", default="auto",
                   help="GPU index per local rank, comma-separated (auto: local rank i on GPU i); GPUs only")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size at the start")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--speeds", type=str, default="", help="comma-separated emulated speed per rank, e.g. 1,0.25")
    p.add_argument("--cost-per-sample", type=float, default=0.002, help="emulated seconds per sample at speed 1")
    p.add_argument("--stock", action="store_true", help="baseline: hvd.DistributedOptimizer + DistributedSampler")
    p.add_argument("--aggregation", default="weighted",
                   choices=["weighted", "deadline", "wbsp", "pseudo_sync", "local_sgd"],
                   help="how each step's gradients are combined (see docs/horovod.md, 'Aggregation modes')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=str, default="")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.devices != "auto" and not all(d.strip().isdigit() for d in args.devices.split(",")):
        p.error(f"--devices must be auto or comma-separated GPU indices, e.g. 0,1; got {args.devices!r}")
    if args.accelerator == "auto":
        args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.accelerator == "cpu" and args.devices != "auto":
        p.error(f"--devices {args.devices} picks GPUs, but the accelerator is the CPU. HINT: on the CPU the ranks "
                "are horovodrun's -np; drop --devices or use --accelerator gpu.")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    rank, world = hvd.rank(), hvd.size()
    if args.accelerator == "gpu":
        gpus = (list(range(torch.cuda.device_count())) if args.devices == "auto"
                else [int(d) for d in args.devices.split(",")])
        if hvd.local_rank() >= len(gpus):
            raise ValueError(f"local rank {hvd.local_rank()} has no GPU: {len(gpus)} listed ({gpus}). HINT: start "
                             "at most one rank per GPU on each host (horovodrun -np, -H host:slots) or list more "
                             "--devices.")
        device = torch.device("cuda", gpus[hvd.local_rank()])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    emu = None
    if args.speeds:
        speeds = [float(s) for s in args.speeds.split(",")]
        if len(speeds) != world:
            raise ValueError(f"--speeds has {len(speeds)} entries for {world} ranks. HINT: give one speed per rank.")
        emu = EmulationModel(speeds, cost_per_sample=args.cost_per_sample)

    train_set, val_set = digits_datasets(seed=args.seed)
    torch.manual_seed(args.seed)
    model = make_model().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.stock:
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        sampler = hh.HeteroBatchSampler(len(train_set), batch_size=args.batch_size, shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_sampler=sampler)
        optimizer = hh.DistributedOptimizer(base, named_parameters=model.named_parameters(), batch_sampler=sampler,
                                            aggregation=args.aggregation, dataset=train_set, model=model)
    loss_fn = nn.CrossEntropyLoss()
    val_x, val_y = (t.to(device) for t in val_set.tensors)

    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        plan = [args.batch_size] * world if args.stock else sampler.plan
        model.train()
        t0 = time.perf_counter()
        for step, batch in enumerate(loader):
            optimizer.zero_grad()
            # The stock optimizer takes the batch whole; ours yields micro-batches in the modes that need them
            # (deadline, wbsp) and the whole batch otherwise.
            for x, y in ([batch] if args.stock else optimizer.micro_batches(batch)):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = loss_fn(model(x), y)
                if emu is not None:
                    time.sleep(emu.delay(rank, epoch, step, len(y)))
                loss.backward()
            optimizer.step()
        if not args.stock:
            optimizer.flush()  # pseudo_sync: apply the last gradient still in flight (a no-op otherwise)
        train_time = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            acc = (model(val_x).argmax(1) == val_y).double().mean()
        acc = float(hvd.allreduce(acc, name="val_acc"))
        epochs.append({"epoch": epoch, "plan": plan, "train_time": train_time, "val_acc": acc})
        if rank == 0:
            print(f"epoch {epoch}: plan {plan} train {train_time:.2f}s val_acc {acc:.3f}", flush=True)

    if rank == 0 and args.json_out:
        out = {
            "mode": "stock" if args.stock else "hetero",
            "accelerator": args.accelerator,
            "world_size": world,
            "speeds": args.speeds,
            "cost_per_sample": args.cost_per_sample,
            "batch_size": args.batch_size,
            "epochs": epochs,
            "plan_history": [] if args.stock else sampler.plan_history,
        }
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_out}; what the balancer did: hetero-plugins report {args.json_out}", flush=True)


if __name__ == "__main__":
    main()
