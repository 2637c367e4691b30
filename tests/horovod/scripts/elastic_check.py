"""Elastic Horovod with ``hetero_plugins.horovod``: run under ``horovodrun -np 3 --min-np 1 --max-np 3
--host-discovery-script ... --gloo python elastic_check.py OUT_DIR HOST_TO_REMOVE HOSTS_TO_ADD`` (three names of
this machine, one slot each, in ``OUT_DIR/hosts``; HOSTS_TO_ADD: ``name:1`` entries, comma-separated).

The job commits every ``COMMIT_EVERY`` steps only (not after every step), so a failure rolls uncommitted steps
back. Every worker keeps the sample indices of its steps since the last commit and writes them (one JSON line per
step, ``OUT_DIR/log-<pid>.jsonl``) once a commit saved them: the union of the logs is what the model learnt from.

- epoch 1, step 3 (between commits): rank 0 drops HOST_TO_REMOVE from ``OUT_DIR/hosts``, the discovery file: a
  graceful removal, which Horovod handles without restoring or syncing the state (``skip_sync``);
- epoch 2, step 5 (between commits): rank 1 kills itself (SIGKILL) before its forward pass, so the other ranks fail
  in the all-reduce of that step, roll back to the commit of step 4 and go on without it;
- epoch 3, step 2 (after a commit): rank 0 appends HOSTS_TO_ADD to the discovery file, so the job grows.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import hetero_plugins.horovod as hh  # noqa: E402

N, EPOCHS, STEP_SLEEP, COMMIT_EVERY = 240, 5, 0.08, 2


def main(out_dir: str, remove: str, extra_hosts: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
    data = TensorDataset(x, y, torch.arange(N))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).double()
    sampler = hh.HeteroBatchSampler(N, batch_size=4, shuffle=True, seed=0)
    loader = DataLoader(data, batch_sampler=sampler)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), batch_sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)
    log = open(os.path.join(out_dir, f"log-{os.getpid()}.jsonl"), "a", buffering=1)
    hosts_file, removed, killed, grown = (os.path.join(out_dir, n) for n in ("hosts", "removed", "killed", "grown"))
    pending: list[dict] = []

    def rewrite_hosts(keep: object, add: list[str]) -> None:
        with open(hosts_file) as f:
            lines = [ln for ln in f.read().split() if keep(ln.split(":")[0])]  # type: ignore[operator]
        with open(hosts_file + ".tmp", "w") as f:
            f.write("".join(f"{ln}\n" for ln in lines + add))
        os.replace(hosts_file + ".tmp", hosts_file)  # the discovery script never reads half a file

    def commit() -> None:
        state.save()  # what state.commit() does, with the committed steps logged in between
        for entry in pending:
            log.write(json.dumps(entry) + "\n")
        pending.clear()
        state.check_host_updates()

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        pending.clear()  # steps after the last commit were rolled back (or never happened)
        while state.epoch < EPOCHS:
            sampler.set_epoch(state.epoch)
            for xb, yb, ib in loader:
                if state.epoch == 2 and sampler.steps_done == 5 and hvd.rank() == 1 and not os.path.exists(killed):
                    open(killed, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                time.sleep(STEP_SLEEP)
                opt.step()
                pending.append({"epoch": state.epoch, "step": sampler.steps_done, "rank": hvd.rank(),
                                "world": hvd.size(), "plan": sampler.plan, "indices": ib.tolist()})
                if state.epoch == 1 and sampler.steps_done == 3 and hvd.rank() == 0 and not os.path.exists(removed):
                    open(removed, "w").close()
                    rewrite_hosts(lambda host: host != remove, [])
                if sampler.steps_done % COMMIT_EVERY == 0:
                    commit()
                if state.epoch == 3 and sampler.steps_done == 2 and hvd.rank() == 0 and not os.path.exists(grown):
                    open(grown, "w").close()
                    rewrite_hosts(lambda host: True, extra_hosts.split(","))
            state.epoch += 1
            commit()

    train(state)
    log.write(json.dumps({"done": True, "rank": hvd.rank(), "world": hvd.size(),
                          "history": sampler.plan_history}) + "\n")
    log.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
