"""Run under ``horovodrun -np 2 --gloo``: the ``aggregation=`` modes of ``hetero_plugins.horovod``.

``python aggregation_check.py OUT.json [PHASE ...]`` runs the phases named (default: all) and rank 0 writes
one JSON object per phase to OUT.json. A float64 MLP on 96 digits samples, 12 per step; rank 1 is slowed
by a sleep proportional to each micro-batch's samples, so stealing and deadlines happen. The dataset holds
each sample's index, so every rank records which samples it processed in each step.

Phases:
    errors          the errors for options a mode does not take (no collectives).
    wbsp            parameters equal one process stepping on each step's union after every step; steals.
    deadline_equiv  "deadline" with a huge slack ends on the same parameters as "weighted".
    deadline_stall  rank 1 stalls in two steps: samples are carried, each step equals one process on the
                    samples it processed, and every sample is still processed once per epoch.
    pseudo_sync     min_confidence=1.0 equals a one-process replay of one-step-delayed SGD (first step
                    skipped, final flush applied).
    local_sgd       communication bytes per epoch vs "weighted"; ranks end on identical parameters.
    init_state      hvd.broadcast_optimizer_state on a new optimizer of each mode: its step() (no backward pass
                    since the last step) only initialises the state, with no exchange; "weighted" then trains
                    exactly like one process on each step's union.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
from typing import Any

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import hetero_plugins.horovod as hh
from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.apps.digits import digits_datasets

N = 96
BATCH = 6  # per rank at the start: global batch 12, 8 steps per epoch
LOSS = torch.nn.CrossEntropyLoss()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_data() -> tuple[torch.Tensor, torch.Tensor, TensorDataset]:
    train, _ = digits_datasets(seed=0, dtype=torch.float64)
    x = torch.stack([train[i][0].reshape(-1) for i in range(N)])
    y = torch.stack([train[i][1] for i in range(N)])
    return x, y, TensorDataset(x, y, torch.arange(N))


def train(
    data: tuple[torch.Tensor, torch.Tensor, TensorDataset],
    aggregation: Any,
    sleep: Any = None,
    reference: str | None = None,
    epochs: int = 2,
    broadcast_state: bool = False,
    min_batch_size: int = 1,
) -> dict[str, Any]:
    """Train two epochs; ``reference``: ``"union"`` (one process on each step's processed samples) or
    ``"delayed"`` (one process applying each step's gradient one step later), compared after every step."""
    x_all, y_all, dataset = data
    rank = hvd.rank()
    model = make_model(0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = copy.deepcopy(model)
    sampler = hh.HeteroBatchSampler(N, batch_size=BATCH, shuffle=True, seed=1, min_batch_size=min_batch_size)
    loader = DataLoader(dataset, batch_sampler=sampler)
    opt = hh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(),
        batch_sampler=sampler, aggregation=aggregation, dataset=dataset,
    )
    if broadcast_state:  # the usual Horovod idiom must work on the wrapper too
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    pending: list[torch.Tensor] | None = None
    worst, steps, partial_steps = 0.0, 0, 0
    plans = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        plans.append(sampler.plan)
        seen: list[int] = []
        for step, batch in enumerate(loader):
            assert batch[2].tolist() == sampler.batch_indices(step), "batch_indices disagrees with the loader"
            opt.zero_grad()
            processed: list[int] = []
            for x, y, i in opt.micro_batches(batch):
                processed += i.tolist()
                loss = LOSS(model(x), y)
                if sleep is not None:
                    time.sleep(sleep(rank, epoch, step, len(y)))
                loss.backward()
            opt.step()
            seen += processed
            steps += 1
            if reference is None:
                continue
            union = sum(hvd.allgather_object(processed, name=f"union.{epoch}.{step}"), [])
            if len(union) != sum(sampler.step_counts(step)):
                partial_steps += 1
            ref_opt.zero_grad()
            LOSS(ref(x_all[union]), y_all[union]).backward()
            if reference == "delayed":
                grads = [p.grad.clone() for p in ref.parameters()]
                if pending is not None:
                    for p, g in zip(ref.parameters(), pending):
                        p.grad = g
                    ref_opt.step()
                pending = grads
            else:
                ref_opt.step()
            d = max_diff(model, ref)
            worst = max(worst, d)
            assert d < 1e-9, f"{aggregation}: epoch {epoch} step {step}: parameters differ from the reference by {d}"
        everything = sorted(sum(hvd.allgather_object(seen, name=f"seen.{epoch}"), []))
        assert everything == list(range(N)), f"{aggregation}: epoch {epoch}: samples not processed exactly once"
    flushed = opt.flush()
    if reference == "delayed" and pending is not None:
        for p, g in zip(ref.parameters(), pending):
            p.grad = g
        ref_opt.step()
        d = max_diff(model, ref)
        worst = max(worst, d)
        assert d < 1e-9, f"{aggregation}: after flush: parameters differ from the reference by {d}"
    params = hvd.allgather_object(flat_params(model).tolist(), name="final_params")
    return {
        "model": model,
        "opt": opt,
        "summary": {
            "worst": worst,
            "steps": steps,
            "epochs": epochs,
            "plans": plans,
            "partial_steps": partial_steps,
            "flushed": bool(flushed),
            "rank_param_diff": float((torch.tensor(params[0]) - torch.tensor(params[1])).abs().max()),
            "communication_bytes": hvd.allgather_object(int(opt.communication_bytes), name="bytes"),
            "communication_rounds": hvd.allgather_object(int(opt.communication_rounds), name="rounds"),
            "carried_samples": hvd.allgather_object(int(opt.carried_samples), name="carried"),
            "stolen_samples": hvd.allgather_object(int(opt.stolen_samples), name="stolen"),
        },
    }


def slow_rank(per_sample: float, stall: tuple[int, set[int], float] | None = None) -> Any:
    """Rank 1 sleeps ``per_sample`` seconds per sample; ``stall``: (epoch, steps, seconds per micro-batch)."""

    def sleep(rank: int, epoch: int, step: int, samples: int) -> float:
        if rank != 1:
            return 0.0
        if stall is not None and epoch == stall[0] and step in stall[1]:
            return stall[2]
        return per_sample * samples

    return sleep


# ------------------------------------------------------------------------------------------------ phases
def phase_errors(data: Any) -> dict[str, Any]:
    x_all, y_all, dataset = data
    model = make_model(0)

    def build(aggregation: Any = "deadline", locality: bool = False, **kw: Any) -> Any:
        sampler = hh.HeteroBatchSampler(N, batch_size=BATCH, seed=1, locality=locality)
        return hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), batch_sampler=sampler,
                                       aggregation=aggregation, **kw)

    cases = {
        "unknown_mode": lambda: build("fastest"),
        "option_not_used": lambda: build(AggregationOptions("deadline", local_steps=2)),
        "backward_passes": lambda: build("deadline", backward_passes_per_step=2),
        "locality": lambda: build("wbsp", locality=True, dataset=dataset),
        "wbsp_without_dataset": lambda: build("wbsp"),
        "wbsp_dataset_not_indexable": lambda: build("wbsp", dataset=5),
        "op_average": lambda: build("pseudo_sync", op=hvd.Average),
        "predivide": lambda: build("local_sgd", gradient_predivide_factor=2.0),
        "compression": lambda: build("local_sgd", compression=hvd.Compression.fp16),
        "not_an_optimizer": lambda: hh.DistributedOptimizer("sgd",
                                                            batch_sampler=hh.HeteroBatchSampler(N, batch_size=BATCH)),
    }
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    opt = build("deadline")
    LOSS(model(x_all[:6]), y_all[:6]).backward()
    try:
        opt.step()
        out["step_without_micro_batches"] = None
    except RuntimeError as err:
        out["step_without_micro_batches"] = str(err)
    return out


def phase_wbsp(data: Any) -> dict[str, Any]:
    run = train(data, AggregationOptions("wbsp", micro_batches=3), sleep=slow_rank(0.01), reference="union",
                broadcast_state=True)
    return run["summary"]


def phase_deadline_equiv(data: Any) -> dict[str, Any]:
    weighted = train(data, "weighted", sleep=slow_rank(0.002))
    deadline = train(data, AggregationOptions("deadline", deadline_slack=1e6), sleep=slow_rank(0.002))
    return {
        "weighted": weighted["summary"],
        "deadline": deadline["summary"],
        "max_diff": max_diff(weighted["model"], deadline["model"]),
    }


def phase_deadline_stall(data: Any) -> dict[str, Any]:
    run = train(data, AggregationOptions("deadline", micro_batches=4), sleep=slow_rank(0.003, (1, {1, 2}, 0.3)),
                reference="union", min_batch_size=4)  # rank 1 keeps several micro-batches to carry
    return run["summary"]


def phase_pseudo_sync(data: Any) -> dict[str, Any]:
    run = train(data, AggregationOptions("pseudo_sync", min_confidence=1.0), sleep=slow_rank(0.002),
                reference="delayed")
    default = train(data, "pseudo_sync")  # the adaptive correction runs (and covers every sample once)
    out = run["summary"]
    out["default_flushed"] = default["summary"]["flushed"]
    return out


def phase_local_sgd(data: Any) -> dict[str, Any]:
    weighted = train(data, "weighted")
    local = train(data, AggregationOptions("local_sgd", local_steps=4))
    return {"weighted": weighted["summary"], "local_sgd": local["summary"]}


def phase_init_state(data: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dataset = data[2]
    for mode in ("weighted", "deadline", "wbsp", "pseudo_sync", "local_sgd"):
        model = make_model(0)
        sampler = hh.HeteroBatchSampler(N, batch_size=BATCH, seed=1)
        opt = hh.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(),
            batch_sampler=sampler, aggregation=mode, dataset=dataset,
        )
        before = flat_params(model)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        out[mode] = {
            "state": len(opt.state_dict()["state"]),
            "rounds": opt.communication_rounds,
            "unchanged": bool(torch.equal(before, flat_params(model))),
            "steps_done": sampler.steps_done,
        }
    weighted = train(data, "weighted", reference="union", broadcast_state=True, epochs=1)
    out["weighted_worst"] = weighted["summary"]["worst"]
    return out


PHASES = {
    "errors": phase_errors,
    "wbsp": phase_wbsp,
    "deadline_equiv": phase_deadline_equiv,
    "deadline_stall": phase_deadline_stall,
    "pseudo_sync": phase_pseudo_sync,
    "local_sgd": phase_local_sgd,
    "init_state": phase_init_state,
}


def main(out_path: str, phases: list[str]) -> None:
    hvd.init()
    torch.set_num_threads(1)
    assert hvd.size() == 2, hvd.size()
    data = load_data()
    results: dict[str, Any] = {}
    for name in phases or list(PHASES):
        t0 = time.perf_counter()
        try:
            results[name] = PHASES[name](data)
        except Exception:
            traceback.print_exc()
            raise
        results[name + "_seconds"] = time.perf_counter() - t0
        if hvd.rank() == 0:
            print(f"phase {name}: {results[name + '_seconds']:.2f}s", flush=True)
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
