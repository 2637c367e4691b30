"""Transfer learning: rebuild the scheduler for a new cluster starting from an existing model.

The seed paper (Zhang, Geng, Ma, IEEE TPDS 2021) rebuilds its scheduling model for a new cluster by
transfer learning; the recipe is not public, so this is the usual equivalent:

- DQN: copy the weights. The scorer is shared across ranks, so a different rank count needs no new output
  head. Fine-tune on the new cluster's decisions with the lower layers frozen for the first
  ``freeze_fraction`` of the budget, then everything at a smaller learning rate, with little exploration,
  keeping the checkpoint that scores best on validation decisions (early stopping).
- Learned relocation (:func:`transfer_placement`): copy the Q-network, fine-tune it by the same fitted
  Q-iteration on the new family at a smaller learning rate, and compare with training from scratch (learning
  curves, closed loop).
- NCF: copy the embeddings of known workloads / device types / co-runners; new names start from the mean
  of the known ones; fine-tune on the new slowdown samples plus the source's own predictions (rehearsal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.progress import progress
from hetero_plugins.scheduler.dqn import DQNTrainer, QNetwork
from hetero_plugins.scheduler.ncf import InterferencePredictor
from hetero_plugins.scheduler.placement_policy import PlacementNetwork
from hetero_plugins.scheduler.pretrain import evaluate_dqn
from hetero_plugins.scheduler.sim import Scenario, decision_problems

__all__ = ["transfer_dqn", "transfer_ncf", "transfer_placement"]


def transfer_dqn(
    scenario: Scenario | str | Path | Mapping[str, Any],
    source: str | Path | QNetwork | None = None,
    seconds: float = 20.0,
    freeze_fraction: float = 0.3,
    lr: float = 1e-4,
    noise_seeds: int = 20,
    seed: int = 0,
    out: str | Path | None = None,
    checkpoints: int = 10,
) -> tuple[QNetwork, dict[str, Any]]:
    """Fine-tune a DQN (default: the shipped one) on ``scenario``'s decisions; save to ``out`` if given.

    The budget runs in ``checkpoints`` slices; after each, the network is scored on *validation* decisions
    (other noise draws of the scenario) and the best one so far, the source included, is kept (early
    stopping, so fine-tuning never returns a network worse on validation than the one it started from).
    Returns the kept network and ``{"before", "after"}``: the mean ratio of true makespans to equal_finish's
    on held-out *test* decisions (lower is better), plus the validation history.
    """
    import torch

    check_float("seconds", seconds, minimum=0.0, strict_minimum=True, hint="give a positive budget, e.g. 20")
    check_float("freeze_fraction", freeze_fraction, minimum=0.0, maximum=1.0, hint="e.g. 0.3")
    check_int("checkpoints", checkpoints, minimum=1, hint="e.g. 10")
    torch.set_num_threads(1)
    net = source if isinstance(source, QNetwork) else QNetwork.load(source)
    rng = np.random.default_rng(seed)
    train = [p for _ in range(noise_seeds) for p in decision_problems(scenario, rng)]
    valid = [p for _ in range(2) for p in decision_problems(scenario, rng)]
    test = [p for _ in range(3) for p in decision_problems(scenario, rng)]
    before = evaluate_dqn(net, test)
    trainer = DQNTrainer(net=net, lr=lr, eps_start=0.1, eps_end=0.02, eps_decay=100, seed=seed)
    best, best_val = net, evaluate_dqn(net, valid)
    history = [round(best_val, 4)]
    trainer.freeze_lower(freeze_fraction > 0)
    for k in progress(range(checkpoints), desc="DQN transfer", unit="round"):
        if k >= freeze_fraction * checkpoints:
            trainer.freeze_lower(False)
            trainer.set_lr(lr / 3)
        trainer.train(train, seconds=seconds / checkpoints)
        cand = trainer.network()
        v = evaluate_dqn(cand, valid)
        history.append(round(v, 4))
        if v < best_val:
            best, best_val = cand, v
    after = evaluate_dqn(best, test)
    stats = {"before": round(before, 4), "after": round(after, 4),
             "kept": "source" if best is net else "fine-tuned", "validation": history,
             "episodes": trainer.episodes, "updates": trainer.updates}
    if out is not None:
        best.save(out, transfer=stats)
    return best, stats


def transfer_ncf(
    samples: Sequence[tuple[str, str, str | None, float]],
    source: str | Path | InterferencePredictor | None = None,
    epochs: int = 200,
    lr: float = 0.005,
    rehearsal: bool = True,
    out: str | Path | None = None,
) -> tuple[InterferencePredictor, dict[str, Any]]:
    """Extend a predictor (default: the shipped one) to the names in ``samples`` and fine-tune on them.

    With ``rehearsal`` the source's predictions for every combination it knew are trained on too, so a few
    new samples do not make it forget the old cluster.
    """
    import torch

    src = source if isinstance(source, InterferencePredictor) else InterferencePredictor.load(source)
    workloads = src.workloads + sorted({w for w, *_ in samples} - set(src.workloads))
    devices = src.devices + sorted({d for _, d, *_ in samples} - set(src.devices))
    corunners = src.corunners + sorted({c for _, _, c, _ in samples if c is not None} - set(src.corunners))
    dst = InterferencePredictor(workloads, devices, corunners, dim=src.dim, tower=src.tower)
    s_state, d_state = src.model.state_dict(), dst.model.state_dict()
    nc_s, nc_d = len(src.corunners), len(dst.corunners)
    with torch.no_grad():
        for key, value in s_state.items():
            if key.endswith("_u.weight"):
                d_state[key][:] = value.mean(0)
                d_state[key][: len(src.workloads)] = value
            elif key.endswith("_i.weight"):
                d_state[key][:] = value.mean(0)
                for di, d in enumerate(src.devices):
                    for ci, c in enumerate(src.corunners):
                        d_state[key][devices.index(d) * nc_d + corunners.index(c)] = value[di * nc_s + ci]
            else:
                d_state[key].copy_(value)
    dst.model.load_state_dict(d_state)
    before = dst.mse(samples)
    rows = list(samples)
    if rehearsal:  # the source's own predictions on what it knew, so fine-tuning does not overwrite them
        known = [(w, d, c) for w in src.workloads for d in src.devices for c in src.corunners[1:]]
        new = {(w, d, c) for w, d, c, _ in samples}
        rows += [(*k, float(s)) for k, s in zip(known, src.predict_many(known)) if k not in new]
        rows += list(samples) * max(1, (len(rows) - len(samples)) // (4 * len(samples)))  # keep the new rows weighty
    dst._train(*dst._ids([(w, d, c) for w, d, c, _ in rows]),
               torch.tensor([float(np.log(max(s, 1.0))) for *_, s in rows]), "neumf", epochs, lr, 0.0, None)
    stats = {"before_mse_log": before, "after_mse_log": dst.mse(samples)}
    if out is not None:
        dst.save(out, transfer=stats)
    return dst, stats


def transfer_placement(
    source: str | Path | PlacementNetwork | None = None,
    family: str = "shifted",
    checkpoints: Sequence[int] = (2, 4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    train_count: int = 80,
    eval_count: int = 12,
    fine_tune_steps: int = 300,
    fine_tune_lr: float = 3e-4,
    scratch_steps: int = 1000,
    scratch_lr: float = 1e-3,
) -> dict[str, Any]:
    """Learning curves of the learned relocation on a new scenario family: fine-tuned from ``source`` (default:
    the shipped model, pre-trained on the ``"default"`` family) against trained from scratch.

    Both run the same fitted Q-iteration (:mod:`hetero_plugins.scheduler.placement_training`) on the *train*
    split of ``family``, one behaviour episode per round; after the rounds listed in ``checkpoints`` the network
    is scored closed loop on the *test* split (scenarios with free slots, of the first ``eval_count``): quality
    is the mean steady throughput relative to the greedy Relocator, with the network deciding alone
    (``keep_greedy=False``: what it learned, not the greedy rule it may defer to). Fine-tuning starts from the source's
    weights with a smaller learning rate and fewer steps per round (the usual recipe; the seed paper's, Zhang,
    Geng, Ma, IEEE TPDS 2021, is not public).

    Returns ``{"family", "checkpoints", "seeds", "curves": {"fine_tuned"|"scratch": {"episodes", "samples",
    "quality" (per seed, per checkpoint), "mean"}}, "source_quality", "verdict"}``; the verdict compares the
    fine-tuned mean at the smallest checkpoint with at most 25% of scratch's final samples to scratch's final
    mean (target: within 2%).
    """
    from hetero_plugins.scheduler.placement_training import collect, evaluate_relocation, relocation_scenarios

    checkpoints = sorted(check_int("checkpoints", int(c), minimum=1) for c in checkpoints)
    src = source.copy() if isinstance(source, PlacementNetwork) else PlacementNetwork.load(source)
    train = [s for s in relocation_scenarios("train", train_count, family) if s.get("free_slots")]
    test = [s for s in relocation_scenarios("test", eval_count, family) if s.get("free_slots")]
    cache: dict[str, float] = {}

    def quality(net: PlacementNetwork) -> float:
        rows = evaluate_relocation(test, net, policies=("learned",), keep_greedy=False)
        for r in rows:
            if r["scenario"] not in cache:
                cache[r["scenario"]] = evaluate_relocation([s for s in test if s["name"] == r["scenario"]],
                                                           policies=("greedy",))[0]["greedy"]
            r["greedy"] = cache[r["scenario"]]
        return float(np.mean([r["learned"] / r["greedy"] for r in rows]))

    curves: dict[str, Any] = {}
    for method in ("fine_tuned", "scratch"):
        q_all, n_all = [], []
        for seed in progress(list(seeds), desc=f"placement transfer ({method})", unit="seed"):
            rng = np.random.default_rng(seed)
            net = src.copy() if method == "fine_tuned" else PlacementNetwork.random(seed=seed)
            steps, lr = (fine_tune_steps, fine_tune_lr) if method == "fine_tuned" else (scratch_steps, scratch_lr)
            order = rng.permutation(len(train))
            xs, ys, qs, ns = None, None, [], []
            adam: dict[str, Any] = {}
            for k in range(checkpoints[-1]):
                explore = 0.2 if method == "fine_tuned" else max(0.1, 0.5 * 0.9 ** k)
                x, y = collect([train[order[k % len(order)]]], net, explore=explore, seed=seed * 1000 + k)
                xs = x if xs is None else np.concatenate([xs, x])
                ys = y if ys is None else np.concatenate([ys, y])
                net.fit(xs, ys, steps=steps, lr=lr, seed=seed * 1000 + k, state=adam)
                if k + 1 in checkpoints:
                    qs.append(round(quality(net), 4))
                    ns.append(int(len(ys)))
            q_all.append(qs)
            n_all.append(ns)
        curves[method] = {"episodes": checkpoints, "samples": np.mean(n_all, axis=0).round(1).tolist(),
                          "quality": q_all, "mean": np.mean(q_all, axis=0).round(4).tolist()}
    final = curves["scratch"]["mean"][-1]
    budget = 0.25 * curves["scratch"]["samples"][-1]
    within = [i for i, n in enumerate(curves["fine_tuned"]["samples"]) if n <= budget]
    ft = curves["fine_tuned"]["mean"][within[-1]] if within else None
    verdict = {"scratch_final": final, "scratch_samples": curves["scratch"]["samples"][-1],
               "fine_tuned_at_25pct": ft,
               "fine_tuned_samples": curves["fine_tuned"]["samples"][within[-1]] if within else None,
               "met": bool(ft is not None and ft >= 0.98 * final)}
    return {"family": family, "checkpoints": checkpoints, "seeds": list(seeds), "curves": curves,
            "source_quality": round(quality(src), 4), "verdict": verdict, "test_scenarios": len(test)}
