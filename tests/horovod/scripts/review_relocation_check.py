"""A relocation rank 0 cannot apply must not stop rank 0 alone: run under ``horovodrun -np 2 -H localhost:2 --gloo
python review_relocation_check.py OUT_DIR MODE``.

Rank 1 is emulated at 0.4x (a t4) beside an idle v100 that the cluster description offers on host ``127.0.0.1``, so
at the first epoch boundary rank 0 decides to move rank 1 there and rewrites the ``hosts_file``. That file lists
``localhost`` without a slot count (``horovodrun --slots-per-host`` decides it), which rank 0 cannot rewrite
safely (MODE ``countless``); or (MODE ``delete``) rank 0 removes the file after building the sampler, so the
rewrite fails with ``FileNotFoundError``. Each rank writes ``OUT_DIR/rank<r>.json`` with its plan history and the
warnings it saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import hetero_plugins.horovod as hh  # noqa: E402
from hetero_plugins.scheduler.relocation import Relocator  # noqa: E402

N, EPOCHS, COST = 192, 2, 0.003


def main(out_dir: str, mode: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    hosts_file = os.path.join(out_dir, "hosts")

    def cluster(epoch: int) -> dict:
        return {"slots": [{"host": "localhost", "device": "v100", "corunner": None},
                          {"host": "localhost", "device": "t4", "corunner": None},
                          {"host": "127.0.0.1", "device": "v100", "corunner": None}]}

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = hh.HeteroBatchSampler(N, batch_size=16, shuffle=True, seed=0, allocator="dqn", cluster=cluster,
                                    relocation=Relocator(restart_cost=0.0), hosts_file=hosts_file,
                                    restart_spec=os.path.join(out_dir, "restart.json"))
    if mode == "delete" and rank == 0:  # the hosts file is gone when rank 0 would rewrite it
        os.remove(hosts_file)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), batch_sampler=sampler)
    loader = DataLoader(data, batch_sampler=sampler)
    speed = 0.4 if rank == 1 else 1.0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                time.sleep(COST * len(y) / speed)
                loss.backward()
                opt.step()
        sampler.set_epoch(EPOCHS)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"plan_history": sampler.plan_history,
                   "hosts": open(hosts_file).read() if os.path.exists(hosts_file) else None,
                   "warnings": [str(w.message) for w in seen if "is not applied" in str(w.message)]}, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
