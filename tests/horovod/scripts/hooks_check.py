"""Run under ``horovodrun -np 2 --gloo``: checks of ``hetero_plugins.horovod`` that assert on every rank.

1. Exactness: float64 MLP, forced uneven plan [3, 5], then the planner's own plans under emulated speeds
   (1, 0.25): after every step the parameters equal one process stepping (SGD with momentum) on the union
   of that step's samples, to 1e-9.
2. Every sample exactly once per epoch across ranks; the plan is identical on all ranks.
3. Gradient accumulation (backward_passes_per_step=2) is exact too.
Rank 0 writes a JSON summary to argv[1].
"""

from __future__ import annotations

import copy
import json
import sys
import time

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import hetero_plugins.horovod as hh
from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.emulation import EmulationModel
from hetero_plugins.telemetry import UtilisationSampler

TOL = 1e-9


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def gather_lists(obj: object, name: str) -> list:
    """Every rank's ``obj``, in rank order."""
    return hvd.allgather_object(obj, name=name)


def main(out_path: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank, world = hvd.rank(), hvd.size()
    assert world == 2, world
    train, _ = digits_datasets(seed=0, dtype=torch.float64)
    sub = Subset(train, range(100))
    x_all = torch.stack([sub[i][0].reshape(-1) for i in range(len(sub))])
    y_all = torch.stack([sub[i][1] for i in range(len(sub))])
    data = TensorDataset(x_all, y_all, torch.arange(len(sub)))  # the index tells which samples a step saw
    loss_fn = torch.nn.CrossEntropyLoss()
    emu = EmulationModel([1.0, 0.25], cost_per_sample=0.003)
    summary: dict = {"epochs": [], "max_diff": 0.0}

    # ---- phase 1: plan [3, 5] forced, then the planner's plans
    model = make_model(0)
    reference = copy.deepcopy(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = hh.HeteroBatchSampler(len(data), batch_size=4, shuffle=True, seed=1)
    sampler.planner.plan = [3, 5]
    loader = DataLoader(data, batch_sampler=sampler)
    opt = hh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(),
        batch_sampler=sampler,
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        plans = gather_lists([sampler.plan], f"plan{epoch}")
        assert all(p == plans[0] for p in plans), f"plans differ across ranks: {plans}"
        if epoch == 0:
            assert sampler.plan == [3, 5], sampler.plan
        t0 = time.perf_counter()
        seen: list[int] = []
        for step, (x, y, i) in enumerate(loader):
            seen += i.tolist()
            opt.zero_grad()
            loss = loss_fn(model(x.reshape(len(x), -1)), y)
            time.sleep(emu.delay(rank, epoch, step, len(y)))
            loss.backward()
            opt.step()
            batches = gather_lists(x.reshape(len(x), -1), f"x{epoch}.{step}")
            union_x = torch.cat(batches)
            union_y = torch.cat(gather_lists(y, f"y{epoch}.{step}"))
            ref_opt.zero_grad()
            loss_fn(reference(union_x), union_y).backward()
            ref_opt.step()
            d = max_diff(model, reference)
            worst = max(worst, d)
            assert d < TOL, f"epoch {epoch} step {step}: params differ from one process on the union by {d}"
        elapsed = time.perf_counter() - t0
        # every sample exactly once: the shards of all ranks over the epoch
        everything = sorted(sum(gather_lists(seen, f"seen{epoch}"), []))
        assert everything == list(range(len(data))), f"epoch {epoch}: samples not exactly once: {everything}"
        summary["epochs"].append({"epoch": epoch, "plan": sampler.plan, "time": elapsed})
    summary["max_diff"] = worst
    summary["plan_history"] = sampler.plan_history
    final_plan = summary["epochs"][-1]["plan"]
    assert final_plan[0] > final_plan[1], f"the fast rank 0 should get more samples: {summary['epochs']}"

    # ---- phase 2: accumulation over two backward passes
    model2 = make_model(1)
    ref2 = copy.deepcopy(model2)
    s2 = hh.HeteroBatchSampler(96, batch_size=4, shuffle=False)
    s2.planner.plan = [5, 3]
    s2.set_epoch(0)
    opt2 = hh.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1), named_parameters=model2.named_parameters(),
        batch_sampler=s2, backward_passes_per_step=2,
    )
    ref_opt2 = torch.optim.SGD(ref2.parameters(), lr=0.1)
    union_x, union_y = [], []
    worst2 = 0.0
    for k, idx in enumerate(s2):
        x, y = x_all[idx], y_all[idx]
        (loss_fn(model2(x), y) / 2).backward()
        union_x += gather_lists(x, f"ax{k}")
        union_y += gather_lists(y, f"ay{k}")
        if k % 2 == 1:
            opt2.step()
            opt2.zero_grad()
            ref_opt2.zero_grad()
            loss_fn(ref2(torch.cat(union_x)), torch.cat(union_y)).backward()
            ref_opt2.step()
            union_x, union_y = [], []
            d = max_diff(model2, ref2)
            worst2 = max(worst2, d)
            assert d < TOL, f"accumulation step {k}: {d}"
    summary["max_diff_accumulation"] = worst2

    # ---- phase 3: the balancing options as one object, and the options this sampler refuses
    # Readings injected as a GPU would give them (rank 0 at 40% and 1 GB, rank 1 at 60% and 2 GB).
    readings = UtilisationSampler(read=lambda: {"gpu_util": 40.0 + 20 * rank, "gpu_mem_used": 1e9 * (rank + 1)},
                                  interval=0.005)
    s3 = hh.HeteroBatchSampler(96, batch_size=4, balancing=BalancingOptions(allocator="lbb", min_batch_size=2,
                                                                          replan_every=None), utilisation=readings)
    s4 = hh.HeteroBatchSampler(96, batch_size=4, allocator="lbb", min_batch_size=2)
    assert s3.options == BalancingOptions(allocator="lbb", min_batch_size=2, replan_every=None), s3.options
    assert s3.planner.allocator.name == s4.planner.allocator.name == "lbb"
    assert hh.HeteroBatchSampler(96, batch_size=4).planner.allocator.name == "auto"  # the default policy
    assert s3.planner.min_batch_size == s4.planner.min_batch_size == 2
    refused = {}
    for name, value in (("balance_eval", False), ("replan_every", 3), ("log_metrics", False),
                        ("memory_headroom", 0.5), ("apply_relocation", False)):
        try:
            hh.HeteroBatchSampler(96, batch_size=4, **{name: value})
        except ValueError as err:
            refused[name] = str(err)
    summary["refused"] = refused
    # Two epochs through the public step hooks (what DistributedOptimizer calls): the records reach the plan.
    for epoch in range(2):
        s3.set_epoch(epoch)
        for idx in s3:
            time.sleep(0.002 * len(idx) * (4 if rank == 1 else 1))
            s3.backward_done()
            s3.step_done()
        assert s3.steps_done == s3.segment().steps
    s3.set_epoch(2)
    summary["hooks_history"] = s3.plan_history
    summary["ok"] = True
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
