"""Pre-training of both stages on simulated clusters (the paper pre-trains both stages before running online).

Stage 1 (LDWP, the DQN) learns from :class:`~hetero_plugins.scheduler.problem.DecisionProblem` episodes drawn from random
heterogeneous clusters (device mixes, memory caps, input-pipeline time, ramps, speed changes, co-runners);
stage 2 (IAWP, the NCF) from a slowdown table sampled the same way. Zhang, Geng, Ma, IEEE TPDS 2021.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.balancing.allocators import Bounds, EqualFinishAllocator
from hetero_plugins.balancing.time_model import TimeModelParams
from hetero_plugins.progress import progress
from hetero_plugins.scheduler.dqn import DQNTrainer, QNetwork, assign
from hetero_plugins.scheduler.features import DecisionContext
from hetero_plugins.scheduler.ncf import InterferencePredictor
from hetero_plugins.scheduler.problem import DecisionProblem
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, decision_problems

__all__ = ["dqn_plan", "evaluate_dqn", "pretrain_dqn", "random_scenario", "training_problems"]


def dqn_plan(net: QNetwork, problem: DecisionProblem) -> np.ndarray:
    """The DQN's greedy split for a decision problem (what the planner would see), as floats."""
    ctx = DecisionContext(problem.intercept, problem.slope, problem.global_batch, problem.max_batch,
                          prev_slope=problem.prev_slope, utilisation=problem.utilisation, data=problem.data)
    return np.asarray(assign(net, ctx, [1] * len(problem.slope)), dtype=np.float64)


def evaluate_dqn(net: QNetwork, problems: list[DecisionProblem]) -> float:
    """Mean ratio of the DQN plan's true next-epoch makespan to equal_finish's (below 1: the DQN wins)."""
    ratios = []
    for p in problems:
        n = len(p.slope)
        bounds = Bounds((1,) * n, tuple(int(c) for c in p.max_batch))
        ef = EqualFinishAllocator().allocate([TimeModelParams(a, b) for a, b in zip(p.intercept, p.slope)],
                                             p.global_batch, bounds)
        ratios.append(p.true_step_time(dqn_plan(net, p)) / p.true_step_time(ef))
    return float(np.mean(ratios))


def random_scenario(rng: np.random.Generator, max_world: int = 16) -> dict[str, Any]:
    """A random heterogeneous cluster scenario (the scenario JSON schema) for pre-training."""
    base = BUILTIN_SCENARIOS["paper_mix"]
    types = list(base["devices"])
    world = int(rng.integers(2, max_world + 1))
    per_rank = int(rng.choice([16, 32, 64]))
    ranks = []
    for _ in range(world):
        data = float(rng.choice([0.0, 0.0, 0.0, rng.uniform(0.002, 0.02)]))
        ranks.append({"device": str(rng.choice(types)), "corunner": None, "data": data})
    events = []
    epochs = 8
    for _ in range(int(rng.integers(0, 4))):
        kind = str(rng.choice(["speed", "ramp", "ramp", "corunner"]))
        picked = sorted({int(r) for r in rng.integers(0, world, int(rng.integers(1, max(2, world // 3) + 1)))})
        ev: dict[str, Any] = {"epoch": int(rng.integers(0, epochs - 1)), "ranks": picked}
        if kind == "speed":
            ev["speed"] = float(rng.uniform(0.5, 2.5))
        elif kind == "ramp":
            ev["ramp"] = float(rng.uniform(1.3, 3.0))
            ev["over"] = int(rng.integers(2, 6))
        else:
            names = [*base["interference"], None]
            ev["corunner"] = names[int(rng.integers(0, len(names)))]
        events.append(ev)
    return {**base, "name": "random", "global_batch": world * per_rank, "ranks": ranks, "events": events,
            "epochs": epochs, "steps_per_epoch": 5, "description": "random"}


def training_problems(count: int, seed: int = 0, max_world: int = 16) -> list[DecisionProblem]:
    """About ``count`` decision problems from random scenarios."""
    rng = np.random.default_rng(seed)
    out: list[DecisionProblem] = []
    while len(out) < count:
        out += decision_problems(random_scenario(rng, max_world), rng)
    return out[:count]


def pretrain_dqn(
    seconds: float = 60.0,
    problems: int = 2000,
    seed: int = 0,
    out: str | Path | None = None,
    net: QNetwork | None = None,
    **trainer_kw: Any,
) -> tuple[QNetwork, dict[str, Any]]:
    """Pre-train the stage-1 DQN for ``seconds`` on random clusters; save to ``out`` if given.

    Training runs in ``rounds`` slices with a decaying learning rate; after each, the network is scored on
    held-out random clusters plus the built-in scenarios (:func:`evaluate_dqn`) and the best one is kept
    (Q-learning drifts: early stopping on validation is the cheap guard).
    """
    import torch

    torch.set_num_threads(1)
    rounds = int(trainer_kw.pop("rounds", 8))
    lr = float(trainer_kw.pop("lr", 3e-4))
    trainer = DQNTrainer(net=net, seed=seed, lr=lr, **trainer_kw)
    train = training_problems(problems, seed=seed)
    rng = np.random.default_rng(seed + 1)
    valid = training_problems(150, seed=seed + 1000)
    for name in ("paper_mix", "dynamic", "interference"):
        valid += decision_problems(name, rng)
    best, best_score, history = trainer.network(), evaluate_dqn(trainer.network(), valid), []
    for k in progress(range(rounds), desc="DQN pre-training", unit="round"):
        trainer.set_lr(lr * (1.0 - k / rounds) + lr / 10)
        trainer.train(train, seconds=seconds / rounds)
        q = trainer.network()
        score = evaluate_dqn(q, valid)
        history.append(round(score, 4))
        if score < best_score:
            best, best_score = q, score
    stats = {"episodes": trainer.episodes, "updates": trainer.updates, "validation": history,
             "best_validation_ratio_to_equal_finish": round(best_score, 4), "seed": seed, "seconds": seconds}
    if out is not None:
        best.save(out, trained=stats)
    return best, stats


#: Resource-pressure model behind the synthetic slowdown table: demand per workload / co-runner and
#: capacity per device on (compute, memory bandwidth, PCIe/host) axes; slowdown = 1 + sum demand*demand/capacity.
_DEMAND = {
    "training": (0.6, 0.5, 0.2), "resnet": (0.7, 0.4, 0.2), "bert": (0.5, 0.7, 0.1), "video": (0.4, 0.3, 0.8),
    "inference": (0.5, 0.2, 0.3), "etl": (0.1, 0.2, 0.9), "gnn": (0.3, 0.8, 0.4),
    "memcpy": (0.05, 0.5, 0.9),  # host <-> device copies: memory bandwidth and PCIe; a co-runner only
}
#: Demand rows that are co-runners only (not workloads of the training job).
_CORUNNER_ONLY = ("memcpy",)
_CAPACITY = {"a100": (2.0, 2.0, 1.2), "v100": (1.2, 1.4, 1.0), "t4": (0.6, 0.6, 0.8), "k80": (0.5, 0.8, 0.6),
             "cpu": (0.8, 1.0, 0.3)}


def slowdown_table(workloads: list[str] | None = None, corunners: list[str] | None = None,
                   noise: float = 0.02, seed: int = 0) -> list[tuple[str, str, str, float]]:
    """Synthetic ``(workload, device, corunner, slowdown)`` rows from a resource-pressure model."""
    rng = np.random.default_rng(seed)
    workloads = workloads or [w for w in _DEMAND if w not in _CORUNNER_ONLY]
    corunners = corunners or ["video", "inference", "etl", "training", "memcpy"]
    rows = []
    for w in workloads:
        for d, cap in _CAPACITY.items():
            for c in corunners:
                s = 1.0 + sum(x * y / k for x, y, k in zip(_DEMAND[w], _DEMAND[c], cap))
                rows.append((w, d, c, float(s * np.exp(rng.normal(0, noise)))))
    return rows


def pretrain_ncf(seconds: float = 20.0, seed: int = 0, out: str | Path | None = None,
                 holdout: float = 0.25) -> tuple[Any, dict[str, Any]]:
    """Pre-train the stage-2 NeuMF on the synthetic slowdown table; report held-out error vs baselines."""
    rows = slowdown_table(seed=seed)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(rows))
    n_test = int(len(rows) * holdout)
    test, train = [rows[i] for i in idx[:n_test]], [rows[i] for i in idx[n_test:]]
    corunners = sorted({c for *_, c, _ in rows})
    p = InterferencePredictor(sorted({w for w, *_ in rows}), sorted(_CAPACITY), corunners, seed=seed)
    untrained = p.mse(test)
    mean_log = float(np.mean(np.log([s for *_, s in train])))
    baseline = float(np.mean((np.log([s for *_, s in test]) - mean_log) ** 2))
    p.fit(train, epochs=400, seconds=seconds)
    stats = {"train_mse_log": p.mse(train), "test_mse_log": p.mse(test), "untrained_test_mse_log": untrained,
             "mean_baseline_test_mse_log": baseline, "train_rows": len(train), "test_rows": len(test), "seed": seed}
    if out is not None:
        p.save(out, trained={k: (round(v, 6) if isinstance(v, float) else v) for k, v in stats.items()})
    return p, stats
