"""Closed-loop evaluation of scheduling policies on many scenarios and seeds: :func:`evaluate`, :func:`best_analytic`.

A *policy* is a batch-split allocator with an optional relocation policy (stage 1 and stage 2 of the
two-stage scheduler of Zhang, Geng, Ma, IEEE TPDS 2021). Each is run by
:func:`~hetero_plugins.scheduler.sim.simulate` on every scenario under every noise seed, and reported by
steady throughput (samples per second after the first epoch) and the steady busy fraction of the simulated
accelerators (the paper's second headline, GPU utilisation), each the mean over the seeds.

Example::

    >>> rows = evaluate(["paper_mix"], {"ef": ("equal_finish", None)}, seeds=(0,), epochs=3)
    >>> rows[0]["policy"], rows[0]["steady_samples_per_s"] > 0, 0 < rows[0]["steady_busy_fraction"] <= 1
    ('ef', True, True)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from hetero_plugins.balancing.allocators import Allocator, get_allocator
from hetero_plugins.scheduler.sim.loop import simulate
from hetero_plugins.scheduler.sim.scenario import Scenario, load_scenario

__all__ = ["ANALYTIC", "AllocatorSpec", "RelocationSpec", "best_analytic", "evaluate", "relative_to_best"]

#: The analytic allocators :func:`best_analytic` takes the best of (no relocation).
ANALYTIC = ("equal_finish", "lbb", "proportional")

#: A registered allocator name, an :class:`Allocator` (deep-copied for every run) or ``factory(scenario) -> Allocator``.
AllocatorSpec = Union[str, Allocator, Callable[[Scenario], Allocator]]
#: ``None``/``False`` (no relocation), ``True`` (the default greedy ``Relocator``) or ``factory(scenario) -> relocator``
#: (an object with ``Relocator.propose``'s keywords, built fresh for every run).
RelocationSpec = Union[None, bool, Callable[[Scenario], Any]]

ScenarioLike = Union[Scenario, str, Path, Mapping[str, Any]]


def _allocator(spec: AllocatorSpec, sc: Scenario) -> Allocator:
    if isinstance(spec, str):
        return get_allocator(spec)
    if isinstance(spec, Allocator):
        return copy.deepcopy(spec)
    if callable(spec):
        return spec(sc)
    raise ValueError(f"evaluate: an allocator spec must be a registered name, an Allocator or factory(scenario), got "
                     f"{spec!r}. HINT: e.g. ('equal_finish', None).")


def _relocation(spec: RelocationSpec, sc: Scenario) -> Any:
    if spec is None or isinstance(spec, bool):
        return spec or None
    if callable(spec):
        return spec(sc)
    raise ValueError(f"evaluate: a relocation spec must be None, True or factory(scenario), got {spec!r}. HINT: e.g. "
                     "lambda sc: Relocator(workload=sc.workload, restart_cost=sc.restart_cost).")


def _check(policies: Mapping[str, tuple[AllocatorSpec, RelocationSpec]], seeds: Sequence[int]) -> None:
    if not isinstance(policies, Mapping) or not policies:
        raise ValueError(f"evaluate: `policies` must map names to (allocator, relocation), got {policies!r}. HINT: "
                         "e.g. {'equal_finish': ('equal_finish', None)}.")
    for name, spec in policies.items():
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise ValueError(f"evaluate: `policies[{name!r}]` must be a pair (allocator, relocation), got {spec!r}. "
                             "HINT: e.g. ('equal_finish', None) or ('equal_finish', True).")
    if not seeds or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise ValueError(f"evaluate: `seeds` must be a non-empty list of integers >= 0, got {seeds!r}. "
                         "HINT: e.g. (0, 1, 2).")


def evaluate(
    scenarios: Iterable[ScenarioLike],
    policies: Mapping[str, tuple[AllocatorSpec, RelocationSpec]],
    seeds: Sequence[int] = (0, 1, 2),
    *,
    epochs: int | None = None,
    replan_every: int | None = None,
) -> list[dict[str, Any]]:
    """Run every policy on every scenario under every seed (a fresh allocator and relocator per run).

    Args:
        scenarios: scenarios (built-in names, files, dicts such as
            :func:`~hetero_plugins.scheduler.sim.family.generate_scenario`'s, or :class:`Scenario`).
        policies: ``{name: (allocator, relocation)}`` (see :data:`AllocatorSpec` and :data:`RelocationSpec`).
        seeds: noise seeds (each overrides the scenario's own).
        epochs: epochs to simulate (default: each scenario's own).
        replan_every: re-plan every this many steps within an epoch as well as at its end (``None``: at epoch ends
            only; the integrations' :class:`~hetero_plugins.balancing.options.BalancingOptions` default is 5).

    Returns:
        one row per scenario and policy, in that order: ``scenario``, ``policy``, ``replan_every``,
        ``steady_samples_per_s`` and
        ``steady_busy_fraction`` (means over the seeds), ``samples_per_s``, ``decision_ms``, ``relocations``
        (moves per run) and ``restarts`` (means), ``wall_s`` (simulation seconds, all seeds) and ``per_seed``
        (``seed``, ``steady_samples_per_s``, ``steady_busy_fraction`` of each run).
    """
    seeds = tuple(seeds)
    _check(policies, seeds)
    rows = []
    for source in scenarios:
        sc = load_scenario(source)
        for name, (alloc, reloc) in policies.items():
            t0 = time.perf_counter()
            runs = []
            for s in seeds:
                out = simulate(sc, _allocator(alloc, sc), epochs=epochs, seed=int(s), relocation=_relocation(reloc, sc),
                               replan_every=replan_every)
                runs.append(out)
            rows.append({
                "scenario": sc.name,
                "policy": name,
                "replan_every": replan_every,
                "steady_samples_per_s": float(np.mean([r["steady_samples_per_s"] for r in runs])),
                "steady_busy_fraction": float(np.mean([r["steady_busy_fraction"] for r in runs])),
                "samples_per_s": float(np.mean([r["samples_per_s"] for r in runs])),
                "decision_ms": float(np.mean([r["decision_ms"] for r in runs])),
                "relocations": float(np.mean([sum(len(m["moves"]) for m in r["relocations"]) for r in runs])),
                "restarts": float(np.mean([r["restarts"] for r in runs])),
                "wall_s": time.perf_counter() - t0,
                "per_seed": [{"seed": int(s), "steady_samples_per_s": r["steady_samples_per_s"],
                              "steady_busy_fraction": r["steady_busy_fraction"]} for s, r in zip(seeds, runs)],
            })
    return rows


def best_analytic(
    scenarios: Iterable[ScenarioLike],
    seeds: Sequence[int] = (0, 1, 2),
    *,
    epochs: int | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
    replan_every: int | None = None,
) -> dict[str, dict[str, Any]]:
    """The best analytic allocator of each scenario: the best mean steady throughput of :data:`ANALYTIC` (no
    relocation), as ``{scenario name: row}`` (an :func:`evaluate` row of the winner, its ``policy`` the allocator).

    ``rows`` (from :func:`evaluate` with the same seeds, epochs and ``replan_every``) are reused where they hold a
    policy named like an analytic allocator; the missing runs are simulated.
    """
    scs = [load_scenario(s) for s in scenarios]
    have: dict[tuple[str, str], Mapping[str, Any]] = {}
    for r in rows or ():
        if r["policy"] in ANALYTIC and [p["seed"] for p in r["per_seed"]] == [int(s) for s in seeds] \
                and r.get("replan_every") == replan_every:
            have[(r["scenario"], r["policy"])] = r
    best: dict[str, dict[str, Any]] = {}
    for sc in scs:
        missing = {a: (a, None) for a in ANALYTIC if (sc.name, a) not in have}
        cand = [dict(have[(sc.name, a)]) for a in ANALYTIC if (sc.name, a) in have]
        if missing:
            cand += evaluate([sc], missing, seeds, epochs=epochs, replan_every=replan_every)
        best[sc.name] = max(cand, key=lambda r: r["steady_samples_per_s"])
    return best


def relative_to_best(rows: Sequence[Mapping[str, Any]], best: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with ``vs_best`` (mean steady throughput over the best analytic allocator's) and ``best_policy``."""
    out = []
    for r in rows:
        b = best[r["scenario"]]
        out.append({**r, "vs_best": r["steady_samples_per_s"] / b["steady_samples_per_s"], "best_policy": b["policy"]})
    return out
