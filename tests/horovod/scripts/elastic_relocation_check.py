"""Elastic Horovod applies a relocation: run under ``horovodrun -np 2 --min-np 2 --max-np 2
--host-discovery-script ... --gloo python elastic_relocation_check.py OUT_DIR FAST0,SLOW,FREE`` (three names
of this machine, one slot each; ``OUT_DIR/hosts`` starts as ``FAST0:1`` and ``SLOW:1``).

The worker on SLOW is emulated at 0.4x (a t4); FREE is an idle v100. The script plays the cluster manager:
its cluster description lists the three slots by host (Horovod numbers the ranks, not the manager). At the first epoch boundary rank 0 decides to move the SLOW rank to FREE and rewrites
the hosts file; Horovod stops the SLOW worker and starts one on FREE; training goes on.

Every worker logs each step's sample indices, plan and host (``OUT_DIR/log-<pid>.jsonl``) before
``state.commit()``; the test asserts on the union of the logs.
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

N, EPOCHS, COST = 384, 4, 0.004


def main(out_dir: str, names: str) -> None:
    fast0, slow, free = names.split(",")
    device = {fast0: "v100", slow: "t4", free: "v100"}
    hosts_file = os.path.join(out_dir, "hosts")

    def cluster(epoch: int) -> dict:  # every slot by host: the job finds its ranks in them
        return {"slots": [{"host": h, "device": d, "corunner": None} for h, d in device.items()]}

    hvd.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g), torch.arange(N))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    sampler = hh.HeteroBatchSampler(N, batch_size=16, shuffle=True, seed=0, allocator="dqn", cluster=cluster,
                                    relocation=Relocator(restart_cost=0.0), hosts_file=hosts_file,
                                    restart_spec=os.path.join(out_dir, "restart.json"))
    loader = DataLoader(data, batch_sampler=sampler)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                  batch_sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)
    host = os.environ["HOROVOD_HOSTNAME"]
    speed = 0.4 if host == slow else 1.0
    log = open(os.path.join(out_dir, f"log-{os.getpid()}.jsonl"), "a", buffering=1)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            sampler.set_epoch(state.epoch)
            for xb, yb, ib in loader:
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                time.sleep(COST * len(yb) / speed)
                loss.backward()
                opt.step()
                log.write(json.dumps({"epoch": state.epoch, "step": sampler.steps_done, "rank": hvd.rank(),
                                      "host": host, "plan": sampler.plan, "indices": ib.tolist(),
                                      "t": time.time()}) + "\n")
                state.commit()
            state.epoch += 1
            state.commit()

    train(state)
    log.write(json.dumps({"done": True, "rank": hvd.rank(), "host": host, "plan": sampler.plan,
                          "history": sampler.plan_history}) + "\n")
    log.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
