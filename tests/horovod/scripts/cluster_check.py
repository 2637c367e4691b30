"""Run under ``horovodrun -np 2 --gloo``: the plain-script sampler with ``allocator="dqn"`` and ``cluster=``.

Both ranks run at the same emulated speed; from epoch 1 the cluster description places a video job beside
rank 1 (which then runs 1.42x slower) and offers an idle v100. Rank 0's plan for epoch 1 must already give rank 1 less work (the NCF's
predicted slowdown, before any step measured it), every rank must adopt the same decision record, and the
relocation must be written as a restart spec. A description with the wrong number of ranks must stop every
rank with the same error. Each rank writes ``rank{r}.json`` into argv[1].
"""

from __future__ import annotations

import json
import os
import sys
import time

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import hetero_plugins.horovod as hh  # noqa: E402
from hetero_plugins.scheduler.relocation import Relocator  # noqa: E402
from tests.lightning_jobs import video_arrives_on_rank_1  # noqa: E402


def main(out_dir: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(384, 8), torch.randint(0, 2, (384,)))
    model = torch.nn.Linear(8, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = hh.HeteroBatchSampler(len(data), batch_size=16, allocator="dqn", cluster=video_arrives_on_rank_1,
                                    relocation=Relocator(restart_cost=0.0),
                                    restart_spec=os.path.join(out_dir, "restart.json"))
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  batch_sampler=sampler)
    loader = DataLoader(data, batch_sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            # Equal emulated speeds, except that the video job announced for rank 1 from epoch 1 slows it as
            # much as the NCF predicts: its measured line then agrees with the description.
            time.sleep(0.005 * len(y) * (1.42 if rank == 1 and epoch >= 1 else 1.0))
            loss.backward()
            opt.step()
    sampler.set_epoch(2)  # plans from epoch 1's timings
    try:
        hh.HeteroBatchSampler(len(data), batch_size=16, cluster=lambda e: {"ranks": [{"device": "v100"}]})
        error = None
    except ValueError as err:
        error = str(err)
    try:
        hh.HeteroBatchSampler(len(data), batch_size=16, hosts_file=os.path.join(out_dir, "missing_hosts"))
        hosts_error = None
    except ValueError as err:
        hosts_error = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"plan_history": sampler.plan_history, "error": error, "hosts_error": hosts_error,
                   "lines": [[p.intercept, p.slope] for p in sampler.planner.model_params()]}, f)


if __name__ == "__main__":
    main(sys.argv[1])
