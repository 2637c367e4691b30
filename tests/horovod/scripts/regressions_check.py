"""Run under ``horovodrun -np 2 --gloo``: regressions of ``hetero_plugins.horovod`` found in review, one phase each;
every rank writes what it saw to ``argv[1]/rank{r}.json`` (the tests assert on both ranks' records).

    autograd_grad   ``"weighted"``, plan [3, 5], a gradient-norm penalty through ``torch.autograd.grad`` (float64):
                    the gradients ``autograd.grad`` returns are unscaled, the sampler counts one step per
                    ``backward()``, and after every step the parameters equal one process stepping on the
                    rank-weighted sum of each rank's loss plus penalty, to 1e-9.
    unused          ``"weighted"``, plan [3, 5], models with a parameter no loss reaches (Horovod's
                    ``synchronize()`` all-reduces it, now started and waited for by the bounded wait): plain,
                    ``groups=2`` (a group left incomplete) and a sparse embedding; exact to 1e-9 each.
    zero_grad       ``"weighted"``: ``optimizer.zero_grad(set_to_none=False)`` leaves zero tensors (not ``None``)
                    and training stays exact.
    synchronize     ``"weighted"``, Horovod's clipping pattern (``optimizer.synchronize()``, clip, step inside
                    ``skip_synchronize()``) with an unused parameter: exact against one process clipping the
                    union's gradient alike, to 1e-9; in ``"deadline"`` ``synchronize()`` raises and says why.
    deadline        ``"deadline"`` checkpoints mid-epoch while rank 1 carries samples: an elastic-style rollback
                    on the same objects, a resume into fresh objects from every rank's own state, and a resume
                    from rank 0's state on every rank (rank 1 warns with its lost samples).
    locality        rank 1 builds the sampler with ``locality=True``, rank 0 without: ``set_epoch`` raises on both.
    load_error      a sampler state whose global batch cannot serve this world raises at ``load_state_dict``;
                    after ``hvd.shutdown()`` (an elastic restore) ``load_state_dict`` still loads quietly.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import warnings
from typing import Any

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import hetero_plugins.horovod as hh
from hetero_plugins.aggregation.options import AggregationOptions

TOL = 1e-9
PLAN = [3, 5]


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def weighted_run(model: torch.nn.Module, loss_of: Any, n: int = 64, epochs: int = 1, zero_to_none: bool = True,
                 lr: float = 0.1, momentum: float = 0.9, inputs: Any = None, clip: float | None = None,
                 **opt_kwargs: Any) -> dict[str, Any]:
    """Train ``model`` under ``"weighted"`` with plan [3, 5] and a reference copy on every step's rank-weighted
    losses; ``loss_of(model, x, y)`` is a rank's loss. ``clip``: Horovod's clipping pattern (``synchronize()``,
    clip the gradient norm to ``clip``, step inside ``skip_synchronize()``), the reference clipped alike.
    Returns the worst difference and what it saw."""
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(n, 6, generator=g, dtype=torch.float64) if inputs is None else inputs(g, n)
    y_all = torch.randint(0, 3, (n,), generator=g)
    data = TensorDataset(x_all, y_all)
    ref = copy.deepcopy(model)
    sampler = hh.HeteroBatchSampler(n, batch_size=4, seed=3)
    sampler.planner.plan = list(PLAN)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                  named_parameters=model.named_parameters(), batch_sampler=sampler, **opt_kwargs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    worst, steps, zeroed = 0.0, [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for k, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
            opt.zero_grad(set_to_none=zero_to_none)
            if (epoch, k) != (0, 0):  # what zero_grad left of the last step's gradients: None, or zero tensors
                zeroed.append(all(p.grad is None if zero_to_none else p.grad is not None and not p.grad.any()
                                  for p in model.parameters()))
            loss_of(model, x, y).backward()
            if clip is None:
                opt.step()
            else:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            steps.append(sampler.steps_done == k + 1)
            pieces = hvd.allgather_object((x, y), name=f"union.{epoch}.{k}")  # every rank's batch
            total = sum(xi.shape[0] for xi, _ in pieces)
            ref_opt.zero_grad()
            sum(loss_of(ref, xi, yi) * (xi.shape[0] / total) for xi, yi in pieces).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            worst = max(worst, max_diff(model, ref))
    return {"worst": worst, "steps_counted": all(steps), "n_steps": len(steps), "zeroed": all(zeroed),
            "plan": sampler.plan}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def phase_autograd_grad() -> dict[str, Any]:
    model = mlp()
    diffs: list[float] = []
    probe = copy.deepcopy(model)

    def loss_of(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(m(x), y)
        grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        if m is model:  # the trained model's autograd.grad against the same gradient with no hook at all
            probe.load_state_dict(m.state_dict())
            plain = torch.autograd.grad(torch.nn.functional.cross_entropy(probe(x), y), list(probe.parameters()))
            diffs.append(max(float((g.detach() - q).abs().max()) for g, q in zip(grads, plain)))
        return loss + 0.1 * sum(g.pow(2).sum() for g in grads)

    out = weighted_run(model, loss_of, epochs=2)
    out["autograd_grad_diff"] = max(diffs)
    return out


class WithUnused(torch.nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = sparse
        self.embed = torch.nn.Embedding(10, 6, sparse=True).double() if sparse else None
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        self.unused = torch.nn.Linear(6, 3).double()  # in the optimizer, in no loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x) if self.embed is not None else x)


def phase_unused() -> dict[str, Any]:
    def loss_of(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(x), y)

    out = {"plain": weighted_run(WithUnused(), loss_of), "groups": weighted_run(WithUnused(), loss_of, groups=2)}
    out["sparse"] = weighted_run(WithUnused(sparse=True), loss_of, momentum=0.0,
                                 inputs=lambda g, n: torch.randint(0, 10, (n,), generator=g))
    return out


def phase_zero_grad() -> dict[str, Any]:
    def loss_of(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(x), y)

    return weighted_run(WithUnused(), loss_of, zero_to_none=False, epochs=2)


def phase_synchronize() -> dict[str, Any]:
    def loss_of(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(x), y)

    out = weighted_run(WithUnused(), loss_of, epochs=2, clip=0.05)  # 0.05: most steps are clipped
    model = mlp()
    sampler = hh.HeteroBatchSampler(64, batch_size=4, seed=3)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  batch_sampler=sampler, aggregation="deadline")
    try:
        opt.synchronize()
        out["explicit_error"] = None
    except RuntimeError as err:
        out["explicit_error"] = str(err)
    return out


# ------------------------------------------------------------------ deadline checkpoints
N = 96


def deadline_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g),
                         torch.arange(N))


def deadline_build(data: TensorDataset) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).double()
    sampler = hh.HeteroBatchSampler(N, batch_size=6, seed=1, min_batch_size=4)
    opt = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), batch_sampler=sampler,
                                  aggregation=AggregationOptions("deadline", micro_batches=4), dataset=data)
    return model, sampler, opt


def deadline_steps(model: Any, sampler: Any, opt: Any, data: Any, epoch: int, stop: int | None = None) -> list[int]:
    """Run epoch ``epoch`` (its rest, when resumed) until ``sampler.steps_done == stop``; the samples processed.
    Rank 1 is slow (3 ms a sample), and stalls 0.3 s a micro-batch in steps 1 and 2 of epoch 1."""
    done: list[int] = []
    for batch in DataLoader(data, batch_sampler=sampler):
        step = sampler.steps_done
        opt.zero_grad()
        for x, y, i in opt.micro_batches(batch):
            done += i.tolist()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if hvd.rank() == 1:
                time.sleep(0.3 if epoch == 1 and step in (1, 2) else 0.003 * len(y))
            loss.backward()
        opt.step()
        if stop is not None and sampler.steps_done == stop:
            break
    return done


def coverage(mine: list[int], name: str) -> dict[str, Any]:
    every = sum(hvd.allgather_object(mine, name=name), [])
    return {"total": len(every), "unique": len(set(every)), "missing": len(set(range(N)) - set(every))}


def phase_deadline() -> dict[str, Any]:
    data = deadline_data()
    model, sampler, opt = deadline_build(data)
    sampler.set_epoch(0)
    deadline_steps(model, sampler, opt, data, 0)
    sampler.set_epoch(1)
    pre = deadline_steps(model, sampler, opt, data, 1, stop=3)
    carried = hvd.allgather_object(opt.aggregator.carry.samples, name="carried")
    state = copy.deepcopy((model.state_dict(), opt.state_dict(), sampler.state_dict()))
    out: dict[str, Any] = {"carried_at_checkpoint": carried}

    # 1. Elastic-style rollback on the same objects: two more steps (their carry differs), then back to the commit.
    deadline_steps(model, sampler, opt, data, 1, stop=5)
    out["carried_before_rollback"] = opt.aggregator.carry.samples
    model.load_state_dict(state[0])
    opt.load_state_dict(copy.deepcopy(state[1]))
    sampler.load_state_dict(copy.deepcopy(state[2]))
    out["carried_after_rollback"] = opt.aggregator.carry.samples  # what later steps carried no longer applies
    sampler.set_epoch(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = deadline_steps(model, sampler, opt, data, 1)
    out["rollback"] = coverage(pre + post, "rollback")
    out["rollback_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    # 2. Resume into fresh objects, every rank from its own state.
    model, sampler, opt = deadline_build(data)
    model.load_state_dict(state[0])
    opt.load_state_dict(copy.deepcopy(state[1]))
    sampler.load_state_dict(copy.deepcopy(state[2]))
    sampler.set_epoch(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = deadline_steps(model, sampler, opt, data, 1)
    out["resumed"] = coverage(pre + post, "resumed")
    out["resumed_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    # 3. Resume with rank 0's state on every rank (a checkpoint rank 0 alone wrote): rank 1's carry is lost, said.
    shared = hvd.broadcast_object(state, root_rank=0, name="rank0_state")
    model, sampler, opt = deadline_build(data)
    model.load_state_dict(shared[0])
    opt.load_state_dict(shared[1])
    sampler.load_state_dict(shared[2])
    sampler.set_epoch(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = deadline_steps(model, sampler, opt, data, 1)
    out["rank0_state"] = coverage(pre + post, "rank0_state")
    out["rank0_state_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def phase_locality() -> dict[str, Any]:
    sampler = hh.HeteroBatchSampler(64, batch_size=4, seed=0, locality=hvd.rank() == 1)
    try:
        sampler.set_epoch(0)
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


def phase_load_error() -> dict[str, Any]:
    out: dict[str, Any] = {}
    sampler = hh.HeteroBatchSampler(64, batch_size=4, seed=0)
    sampler.set_epoch(0)
    good = sampler.state_dict()
    bad = dict(good, global_batch=1, seg_plan=[1], planner=sampler.options.planner(1, 1).state_dict())
    try:
        hh.HeteroBatchSampler(64, batch_size=4, seed=0).load_state_dict(bad)
        out["error"] = None
    except ValueError as err:
        out["error"] = str(err)
    hvd.shutdown()  # an elastic restore loads between Horovod's shutdown and init
    try:
        sampler.load_state_dict(good)
        out["after_shutdown"] = "loaded"
    except Exception as err:  # noqa: BLE001 - recorded for the test
        out["after_shutdown"] = f"{type(err).__name__}: {err}"
    return out


PHASES = {"autograd_grad": phase_autograd_grad, "unused": phase_unused, "zero_grad": phase_zero_grad,
          "synchronize": phase_synchronize,
          "deadline": phase_deadline, "locality": phase_locality, "load_error": phase_load_error}


def main(out_dir: str, phases: list[str]) -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    results: dict[str, Any] = {}
    for name in phases:  # load_error shuts Horovod down: keep it last
        try:
            results[name] = PHASES[name]()
        except Exception as err:  # recorded for the test, which names the phase; the job ends on it
            results[name] = {"crashed": f"{type(err).__name__}: {err}"}
            raise
        finally:
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(PHASES))
