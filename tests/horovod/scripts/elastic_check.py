"""Elastic Horovod with ``hetero_plugins.horovod``: run under
``horovodrun -np 2 --min-np 1 --max-np 3 --host-discovery-script ... --gloo python elastic_check.py OUT_DIR
HOSTS`` (HOSTS: the two ``name:1`` entries to add, comma-separated).

Every worker logs, after each optimizer step and before ``state.commit()``, the sample indices it
processed (one JSON line per step, in ``OUT_DIR/log-<pid>.jsonl``). The test asserts on the union of the logs.

- epoch 1, step 3: the worker with rank 1 kills itself (SIGKILL) right after its commit, so the others fail
  in the next all-reduce, roll back to that commit and continue with one worker fewer;
- epoch 2, step 2: rank 0 appends HOSTS to ``OUT_DIR/hosts``, the discovery file, so the job grows (up to ``--max-np 3``).
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

N, EPOCHS, STEP_SLEEP = 240, 4, 0.08


def main(out_dir: str, extra_hosts: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
    data = TensorDataset(x, y, torch.arange(N))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).double()
    sampler = hh.HeteroBatchSampler(N, batch_size=4, shuffle=True, seed=0)
    loader = DataLoader(data, batch_sampler=sampler)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                  batch_sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)
    log = open(os.path.join(out_dir, f"log-{os.getpid()}.jsonl"), "a", buffering=1)
    kill_marker = os.path.join(out_dir, "killed")
    grow_marker = os.path.join(out_dir, "grown")
    hosts_file = os.path.join(out_dir, "hosts")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            sampler.set_epoch(state.epoch)
            for xb, yb, ib in loader:
                if state.epoch == 1 and sampler.steps_done == 3 and hvd.rank() == 1 and not os.path.exists(kill_marker):
                    open(kill_marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                time.sleep(STEP_SLEEP)
                opt.step()
                log.write(json.dumps({"epoch": state.epoch, "step": sampler.steps_done, "rank": hvd.rank(),
                                      "world": hvd.size(), "plan": sampler.plan, "indices": ib.tolist()}) + "\n")
                state.commit()
                if state.epoch == 2 and sampler.steps_done == 2 and hvd.rank() == 0 and not os.path.exists(grow_marker):
                    open(grow_marker, "w").close()
                    with open(hosts_file, "a") as f:
                        f.write("".join(f"{h}\n" for h in extra_hosts.split(",")))
            state.epoch += 1
            state.commit()

    train(state)
    log.write(json.dumps({"done": True, "rank": hvd.rank(), "world": hvd.size(), "history": sampler.plan_history}) + "\n")
    log.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
