"""A cluster simulator for the balancing loop: per-rank true step times, events, and the planner in the loop.

The learned scheduler (issue 4, :mod:`hetero_plugins.scheduler`) is pre-trained and benchmarked here, the way
the two-stage scheduler of Zhang, Geng, Ma ("Learning-Driven Interference-Aware Workload Parallelization for
Streaming Applications in Heterogeneous Cluster", IEEE TPDS 2021) is pre-trained before it runs online.

Model of one step on rank i, epoch e (all ranks wait at the gradient barrier for the slowest)::

    t_i(b) = (intercept_d + slope_d * b) * mult_i(e) * noise_i(e, step) + data_i

- ``intercept_d``/``slope_d`` belong to the rank's device type ``d`` (a CPU, an old or a new GPU...);
- ``mult_i(e)`` is the product of the events in force: ``speed`` (a step change of the time multiplier),
  ``ramp`` (a non-dedicated node's background load growing linearly over some epochs) and ``corunner``
  (a co-located job whose slowdown on this device type comes from the scenario's ``interference`` table);
- ``noise`` is multiplicative, seeded by (seed, epoch, step, rank) and independent of ``b``, so times are
  monotone in the batch size and a run is deterministic for a seed;
- ``data_i`` is a per-step cost outside the measured compute window (input pipeline, host copies): the
  planner's time models never see it, so analytic allocators cannot correct for it.

Scenarios are JSON-like dicts validated by :func:`load_scenario`; :data:`BUILTIN_SCENARIOS` holds
``paper_mix`` (a CPU-GPU mix in the spirit of the seed paper's cluster), ``interference`` (co-runners arrive
and leave), ``dynamic`` (non-dedicated nodes: ramps, a speed change and slow input pipelines) and ``large``
(1024 ranks).

Example::

    >>> sc = load_scenario("paper_mix")
    >>> sim = ClusterSim(sc)
    >>> out = simulate(sc, "equal_finish", epochs=3)
    >>> out["epoch_times"][2] < out["epoch_times"][0]
    True
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.allocators import Allocator, get_allocator
from hetero_plugins.metrics import straggler_level
from hetero_plugins.planner import BalancePlanner

__all__ = [
    "BUILTIN_SCENARIOS",
    "ClusterSim",
    "DecisionProblem",
    "Scenario",
    "decision_problems",
    "load_scenario",
    "simulate",
]

EVENT_KINDS = ("speed", "ramp", "corunner")

_SCHEMA_HINT = (
    "a scenario is {'name', 'global_batch', 'device_types': {name: {'intercept', 'slope', 'max_batch'?}}, "
    "'ranks': [{'device', 'count'?, 'data'?}], 'epochs'?, 'steps_per_epoch'?, 'noise'?, 'seed'?, "
    "'workload'?, 'interference'?: {corunner: {device_type: slowdown}}, 'events'?: [{'epoch', 'kind', 'ranks', ...}]}"
)


@dataclass(frozen=True)
class Scenario:
    """A validated scenario (see :func:`load_scenario` for the JSON form).

    Attributes:
        name: label.
        global_batch: samples per optimizer step over all ranks.
        device: device type of each rank.
        intercept: per-rank fixed seconds per step (from the device type).
        slope: per-rank seconds per sample (from the device type).
        max_batch: per-rank memory cap on the local batch (``None``: unbounded).
        data: per-rank seconds per step outside the measured compute window.
        events: validated events, each a dict with ``epoch``, ``kind``, ``ranks`` and kind-specific keys.
        interference: slowdown of a device type when a co-runner shares it, ``{corunner: {device: factor}}``.
        workload: the training job's workload type (the NCF's "user").
        epochs: default number of epochs to simulate.
        steps_per_epoch: optimizer steps per epoch.
        noise: standard deviation of the multiplicative log-normal step noise.
        seed: seed of the noise.
    """

    name: str
    global_batch: int
    device: tuple[str, ...]
    intercept: tuple[float, ...]
    slope: tuple[float, ...]
    max_batch: tuple[int | None, ...]
    data: tuple[float, ...]
    events: tuple[dict[str, Any], ...]
    interference: dict[str, dict[str, float]]
    workload: str
    epochs: int
    steps_per_epoch: int
    noise: float
    seed: int

    @property
    def world_size(self) -> int:
        return len(self.device)


def _err(field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"scenario field `{field}` is invalid: got {value!r}. HINT: {fix}")


def _num(field: str, value: Any, *, minimum: float = 0.0, strict: bool = False, integer: bool = False) -> Any:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):
        kind = "an integer" if integer else "a finite number"
        raise _err(field, value, f"use {kind} {'>' if strict else '>='} {minimum}.")
    if value < minimum or (strict and value == minimum):
        raise _err(field, value, f"use a value {'>' if strict else '>='} {minimum}.")
    return value


def load_scenario(source: str | Path | Mapping[str, Any]) -> Scenario:
    """Validate a scenario given as a built-in name, a JSON file path or a dict.

    Raises:
        ValueError: naming the offending field, the value and the fix.

    Example::

        >>> load_scenario({"name": "x", "global_batch": 8, "device_types": {"g": {"intercept": 0, "slope": 1}},
        ...                "ranks": [{"device": "g", "count": 2}]}).world_size
        2
        >>> load_scenario({"name": "x", "global_batch": 8, "device_types": {}, "ranks": []})
        Traceback (most recent call last):
        ...
        ValueError: scenario field `device_types` is invalid: got {}. HINT: give at least one device type, e.g. {"gpu": {"intercept": 0.005, "slope": 0.001}}.
    """
    if isinstance(source, Path) or (isinstance(source, str) and source not in BUILTIN_SCENARIOS):
        path = Path(source)
        if not path.is_file():
            raise ValueError(
                f"scenario {str(source)!r} is neither a built-in scenario ({sorted(BUILTIN_SCENARIOS)}) nor a "
                "JSON file. HINT: pass one of the built-in names or the path of a scenario JSON file."
            )
        try:
            spec = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"scenario file {str(path)!r} is not valid JSON: {err}. HINT: fix the JSON syntax.") from err
    elif isinstance(source, str):
        spec = copy.deepcopy(BUILTIN_SCENARIOS[source])
    else:
        spec = copy.deepcopy(dict(source))
    if not isinstance(spec, dict):
        raise ValueError(f"a scenario must be a JSON object, got {type(spec).__name__}. HINT: {_SCHEMA_HINT}")
    known = {"name", "global_batch", "device_types", "ranks", "events", "interference", "workload", "epochs",
             "steps_per_epoch", "noise", "seed", "description"}
    for key in spec:
        if key not in known:
            raise _err(key, spec[key], f"remove it; known fields are {sorted(known)}.")
    for key in ("name", "global_batch", "device_types", "ranks"):
        if key not in spec:
            raise ValueError(f"scenario field `{key}` is missing. HINT: {_SCHEMA_HINT}")
    name = spec["name"]
    if not isinstance(name, str) or not name:
        raise _err("name", name, "use a non-empty string.")
    types = spec["device_types"]
    if not isinstance(types, dict) or not types:
        raise _err("device_types", types, 'give at least one device type, e.g. {"gpu": {"intercept": 0.005, "slope": 0.001}}.')
    parsed_types: dict[str, tuple[float, float, int | None]] = {}
    for tname, t in types.items():
        f = f"device_types.{tname}"
        if not isinstance(t, dict):
            raise _err(f, t, 'use {"intercept": seconds, "slope": seconds per sample, "max_batch": int (optional)}.')
        for key in t:
            if key not in ("intercept", "slope", "max_batch"):
                raise _err(f"{f}.{key}", t[key], "remove it; a device type has intercept, slope and max_batch.")
        if "slope" not in t:
            raise ValueError(f"scenario field `{f}.slope` is missing. HINT: give seconds per sample, e.g. 0.001.")
        slope = _num(f"{f}.slope", t["slope"], strict=True)
        intercept = _num(f"{f}.intercept", t.get("intercept", 0.0))
        mb = t.get("max_batch")
        if mb is not None:
            mb = _num(f"{f}.max_batch", mb, minimum=1, integer=True)
        parsed_types[tname] = (float(intercept), float(slope), mb)
    ranks = spec["ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise _err("ranks", ranks, 'give a list of rank groups, e.g. [{"device": "gpu", "count": 4}].')
    device: list[str] = []
    data: list[float] = []
    for g, group in enumerate(ranks):
        f = f"ranks[{g}]"
        if not isinstance(group, dict) or "device" not in group:
            raise _err(f, group, 'use {"device": <a name from device_types>, "count": n, "data": seconds}.')
        for key in group:
            if key not in ("device", "count", "data"):
                raise _err(f"{f}.{key}", group[key], "remove it; a rank group has device, count and data.")
        if group["device"] not in parsed_types:
            raise _err(f"{f}.device", group["device"], f"use one of the device_types {sorted(parsed_types)}.")
        count = _num(f"{f}.count", group.get("count", 1), minimum=1, integer=True)
        d = float(_num(f"{f}.data", group.get("data", 0.0)))
        device += [group["device"]] * count
        data += [d] * count
    world = len(device)
    gb = _num("global_batch", spec["global_batch"], minimum=world, integer=True)
    caps = [parsed_types[d][2] for d in device]
    if all(c is not None for c in caps) and sum(caps) < gb:  # type: ignore[arg-type]
        raise _err("global_batch", gb, f"the ranks' max_batch sum to {sum(caps)}; lower global_batch or raise max_batch.")  # type: ignore[arg-type]
    interference = spec.get("interference", {})
    if not isinstance(interference, dict):
        raise _err("interference", interference, 'use {"corunner": {"device_type": slowdown >= 1}}.')
    for cname, row in interference.items():
        if not isinstance(row, dict):
            raise _err(f"interference.{cname}", row, 'use {"device_type": slowdown >= 1}.')
        for dname, v in row.items():
            if dname not in parsed_types:
                raise _err(f"interference.{cname}.{dname}", dname, f"use one of the device_types {sorted(parsed_types)}.")
            _num(f"interference.{cname}.{dname}", v, minimum=1.0)
    events = spec.get("events", [])
    if not isinstance(events, list):
        raise _err("events", events, "use a list of events.")
    parsed_events = []
    for k, ev in enumerate(events):
        f = f"events[{k}]"
        if not isinstance(ev, dict):
            raise _err(f, ev, 'use {"epoch": e, "kind": "speed"|"ramp"|"corunner", "ranks": [...], ...}.')
        kind = ev.get("kind")
        if kind not in EVENT_KINDS:
            raise _err(f"{f}.kind", kind, f"use one of {list(EVENT_KINDS)}.")
        allowed = {"epoch", "kind", "ranks", "factor", "epochs", "corunner"}
        for key in ev:
            if key not in allowed:
                raise _err(f"{f}.{key}", ev[key], f"remove it; an event has {sorted(allowed)}.")
        epoch = _num(f"{f}.epoch", ev.get("epoch"), minimum=0, integer=True)
        rs = ev.get("ranks")
        if not isinstance(rs, list) or not rs or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world for r in rs):
            raise _err(f"{f}.ranks", rs, f"use a non-empty list of rank indices in [0, {world - 1}].")
        out: dict[str, Any] = {"epoch": epoch, "kind": kind, "ranks": list(rs)}
        if kind in ("speed", "ramp"):
            out["factor"] = float(_num(f"{f}.factor", ev.get("factor"), strict=True))
            if kind == "ramp":
                out["epochs"] = _num(f"{f}.epochs", ev.get("epochs", 1), minimum=1, integer=True)
        else:
            c = ev.get("corunner")
            if c is not None and c not in interference:
                raise _err(f"{f}.corunner", c, f"use null (co-runner leaves) or one of the interference rows {sorted(interference)}.")
            out["corunner"] = c
        parsed_events.append(out)
    workload = spec.get("workload", "training")
    if not isinstance(workload, str):
        raise _err("workload", workload, "use a string such as 'resnet' or 'training'.")
    return Scenario(
        name=name,
        global_batch=gb,
        device=tuple(device),
        intercept=tuple(parsed_types[d][0] for d in device),
        slope=tuple(parsed_types[d][1] for d in device),
        max_batch=tuple(caps),
        data=tuple(data),
        events=tuple(parsed_events),
        interference={c: {d: float(v) for d, v in row.items()} for c, row in interference.items()},
        workload=workload,
        epochs=_num("epochs", spec.get("epochs", 10), minimum=1, integer=True),
        steps_per_epoch=_num("steps_per_epoch", spec.get("steps_per_epoch", 20), minimum=1, integer=True),
        noise=float(_num("noise", spec.get("noise", 0.02))),
        seed=_num("seed", spec.get("seed", 0), minimum=0, integer=True),
    )


class ClusterSim:
    """True per-rank step times of a :class:`Scenario`.

    Args:
        scenario: a :class:`Scenario`, a built-in name, a JSON path or a dict.
        seed: overrides the scenario's noise seed.
    """

    def __init__(self, scenario: Scenario | str | Path | Mapping[str, Any], seed: int | None = None) -> None:
        self.scenario = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        self.seed = self.scenario.seed if seed is None else int(seed)
        sc = self.scenario
        self._a = np.asarray(sc.intercept, dtype=np.float64)
        self._beta = np.asarray(sc.slope, dtype=np.float64)
        self._data = np.asarray(sc.data, dtype=np.float64)

    @property
    def world_size(self) -> int:
        return self.scenario.world_size

    def multipliers(self, epoch: int) -> np.ndarray:
        """Each rank's time multiplier in ``epoch`` (events applied in order)."""
        sc = self.scenario
        mult = np.ones(sc.world_size)
        corunner: dict[int, str | None] = {}
        for ev in sc.events:
            if ev["epoch"] > epoch:
                continue
            for r in ev["ranks"]:
                if ev["kind"] == "speed":
                    mult[r] = ev["factor"]
                elif ev["kind"] == "ramp":
                    frac = min(1.0, (epoch - ev["epoch"] + 1) / ev["epochs"])
                    mult[r] = 1.0 + (ev["factor"] - 1.0) * frac
                else:
                    corunner[r] = ev["corunner"]
        for r, c in corunner.items():
            if c is not None:
                mult[r] *= sc.interference[c].get(sc.device[r], 1.0)
        return mult

    def corunners(self, epoch: int) -> list[str | None]:
        """Each rank's co-runner in ``epoch`` (``None``: dedicated)."""
        out: list[str | None] = [None] * self.world_size
        for ev in self.scenario.events:
            if ev["kind"] == "corunner" and ev["epoch"] <= epoch:
                for r in ev["ranks"]:
                    out[r] = ev["corunner"]
        return out

    def params(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Noise-free ``(intercept, slope, data)`` per rank in ``epoch``."""
        m = self.multipliers(epoch)
        return self._a * m, self._beta * m, self._data.copy()

    def step_times(self, epoch: int, step: int, plan: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(compute, data)`` seconds of every rank for one step under ``plan``; monotone in each batch size."""
        a, beta, data = self.params(epoch)
        noise = self._noise(epoch, step)
        compute = (a + beta * np.asarray(plan, dtype=np.float64)) * noise
        return compute, data

    def _noise(self, epoch: int, step: int) -> np.ndarray:
        if self.scenario.noise == 0:
            return np.ones(self.world_size)
        rng = np.random.default_rng([self.seed, epoch, step])
        return np.exp(rng.normal(0.0, self.scenario.noise, self.world_size))

    def true_makespan(self, epoch: int, plan: Sequence[int]) -> float:
        """Noise-free step time (slowest rank, data time included) of ``plan`` in ``epoch``."""
        a, beta, data = self.params(epoch)
        return float(np.max(a + beta * np.asarray(plan, dtype=np.float64) + data))


def simulate(
    scenario: Scenario | str | Path | Mapping[str, Any],
    allocator: str | Allocator = "equal_finish",
    epochs: int | None = None,
    seed: int | None = None,
    min_gain: float = 0.03,
    telemetry: bool = True,
) -> dict[str, Any]:
    """Run the balancing loop (:class:`~hetero_plugins.planner.BalancePlanner`) against the simulated cluster.

    Every epoch runs ``steps_per_epoch`` steps under the current plan; the planner observes the measured
    compute times (data time is outside its window, as in :class:`~hetero_plugins.callbacks.BatchBalancer`)
    and plans the next epoch. With ``telemetry``, allocators with a ``set_context`` method also get per-rank
    utilisation by other processes and data seconds per step (the Lightning integration does not pass these
    yet: ``telemetry=False`` simulates what a Lightning run gives the learned allocators).

    Returns:
        dict with ``epoch_times`` (seconds), ``total_time``, ``samples_per_s``, ``plans``, ``straggler_level``
        per epoch, and ``decision_ms`` (mean wall time of one planning call).
    """
    import time

    sim = ClusterSim(scenario, seed=seed)
    sc = sim.scenario
    epochs = sc.epochs if epochs is None else int(epochs)
    alloc = get_allocator(allocator) if isinstance(allocator, str) else allocator
    planner = BalancePlanner(sc.world_size, sc.global_batch, allocator=alloc, min_gain=min_gain)
    caps = list(sc.max_batch)
    epoch_times, plans, levels, decide = [], [], [], []
    for e in range(epochs):
        plan = list(planner.plan)
        plans.append(plan)
        records = np.zeros((sc.world_size, sc.steps_per_epoch, 3))
        total = 0.0
        for s in range(sc.steps_per_epoch):
            compute, data = sim.step_times(e, s, plan)
            records[:, s, 0] = plan
            records[:, s, 1] = compute
            records[:, s, 2] = data
            total += float(np.max(compute + data))
        epoch_times.append(total)
        levels.append(straggler_level(records[:, :, 1].mean(axis=1) + records[:, :, 2].mean(axis=1)))
        if telemetry and hasattr(alloc, "set_context"):
            mult = sim.multipliers(e)
            alloc.set_context(utilisation=list(1.0 - 1.0 / mult), data=list(records[:, :, 2].mean(axis=1)))
        t0 = time.perf_counter()
        planner.end_epoch(e, records, epoch_time=total, memory_caps=caps)
        decide.append(time.perf_counter() - t0)
    samples = sc.global_batch * sc.steps_per_epoch * epochs
    return {
        "scenario": sc.name,
        "allocator": getattr(alloc, "name", type(alloc).__name__),
        "world_size": sc.world_size,
        "epochs": epochs,
        "epoch_times": epoch_times,
        "total_time": float(sum(epoch_times)),
        "samples_per_s": samples / float(sum(epoch_times)),
        "straggler_level": levels,
        "plans": plans,
        "decision_ms": 1000.0 * float(np.mean(decide)),
    }


@dataclass(frozen=True)
class DecisionProblem:
    """One planning decision for pre-training: what the planner would see, and what the next epoch will be.

    Attributes:
        intercept, slope: observed per-rank time lines (the current epoch's, with fitting noise).
        prev_slope: the slopes observed one decision earlier (for the trend feature).
        utilisation: per-rank utilisation by other processes in the current epoch.
        data: per-rank data seconds per step (outside the compute window).
        true_intercept, true_slope, true_data: the next epoch's noise-free parameters (the reward's truth).
        global_batch: samples to split.
        max_batch: per-rank caps.
    """

    intercept: np.ndarray
    slope: np.ndarray
    prev_slope: np.ndarray
    utilisation: np.ndarray
    data: np.ndarray
    true_intercept: np.ndarray
    true_slope: np.ndarray
    true_data: np.ndarray
    global_batch: int
    max_batch: np.ndarray


def decision_problems(
    scenario: Scenario | str | Path | Mapping[str, Any],
    rng: np.random.Generator,
    fit_noise: float = 0.03,
) -> list[DecisionProblem]:
    """One :class:`DecisionProblem` per epoch boundary of a scenario (epoch e observed, epoch e+1 true)."""
    sim = ClusterSim(scenario)
    sc = sim.scenario
    caps = np.array([c if c is not None else sc.global_batch for c in sc.max_batch], dtype=np.float64)
    out = []
    prev_beta = None
    for e in range(sc.epochs - 1):
        a, beta, data = sim.params(e)
        a2, beta2, data2 = sim.params(e + 1)
        m = sim.multipliers(e)
        jitter = np.exp(rng.normal(0.0, fit_noise, sc.world_size))
        obs_beta = beta * jitter
        out.append(DecisionProblem(
            intercept=a * jitter, slope=obs_beta, prev_slope=obs_beta if prev_beta is None else prev_beta,
            utilisation=1.0 - 1.0 / m, data=data, true_intercept=a2, true_slope=beta2, true_data=data2,
            global_batch=sc.global_batch, max_batch=caps,
        ))
        prev_beta = obs_beta
    return out


def _mix(name: str, groups: list[tuple[str, int, float]], gb: int, **extra: Any) -> dict[str, Any]:
    spec = {
        "name": name,
        "global_batch": gb,
        "workload": "training",
        "device_types": {
            "a100": {"intercept": 0.004, "slope": 0.00025, "max_batch": 1024},
            "v100": {"intercept": 0.005, "slope": 0.0005, "max_batch": 512},
            "t4": {"intercept": 0.006, "slope": 0.0012, "max_batch": 256},
            "k80": {"intercept": 0.008, "slope": 0.0025, "max_batch": 256},
            "cpu": {"intercept": 0.010, "slope": 0.0060, "max_batch": 512},
        },
        "ranks": [{"device": d, "count": n, "data": data} for d, n, data in groups],
        "interference": {
            "video": {"a100": 1.3, "v100": 1.5, "t4": 1.9, "k80": 1.7, "cpu": 1.4},
            "inference": {"a100": 1.15, "v100": 1.25, "t4": 1.5, "k80": 1.35, "cpu": 1.2},
            "etl": {"a100": 1.05, "v100": 1.05, "t4": 1.1, "k80": 1.1, "cpu": 2.2},
        },
    }
    spec.update(extra)
    return spec


#: Built-in scenarios (JSON form; load with :func:`load_scenario`).
BUILTIN_SCENARIOS: dict[str, dict[str, Any]] = {
    "paper_mix": _mix(
        "paper_mix", [("v100", 2, 0.0), ("t4", 2, 0.0), ("k80", 2, 0.0), ("cpu", 2, 0.0)], 512,
        description="CPU-GPU heterogeneous cluster (seed paper's setting, Zhang et al. TPDS 2021); one slowdown.",
        epochs=10, steps_per_epoch=20, noise=0.02,
        events=[{"epoch": 5, "kind": "speed", "ranks": [1], "factor": 1.6}],
    ),
    "interference": _mix(
        "interference", [("v100", 4, 0.0), ("t4", 4, 0.0)], 512,
        description="Co-located streaming jobs arrive on and leave some GPUs (the IAWP stage's setting).",
        epochs=10, steps_per_epoch=20, noise=0.02,
        events=[
            {"epoch": 2, "kind": "corunner", "ranks": [0, 4], "corunner": "video"},
            {"epoch": 4, "kind": "corunner", "ranks": [5], "corunner": "inference"},
            {"epoch": 6, "kind": "corunner", "ranks": [0], "corunner": None},
            {"epoch": 7, "kind": "corunner", "ranks": [2, 6], "corunner": "video"},
        ],
    ),
    "dynamic": _mix(
        "dynamic", [("v100", 4, 0.0), ("t4", 2, 0.004), ("k80", 2, 0.0)], 512,
        description="Non-dedicated nodes: background load ramps up, a node slows, two ranks have slow input pipelines.",
        epochs=12, steps_per_epoch=20, noise=0.02,
        events=[
            {"epoch": 1, "kind": "ramp", "ranks": [0, 1], "factor": 2.5, "epochs": 6},
            {"epoch": 3, "kind": "ramp", "ranks": [6], "factor": 2.0, "epochs": 5},
            {"epoch": 8, "kind": "speed", "ranks": [0, 1], "factor": 1.0},
        ],
    ),
    "large": _mix(
        "large", [("a100", 256, 0.0), ("v100", 256, 0.0), ("t4", 256, 0.0), ("k80", 256, 0.0)], 32768,
        description="1024 ranks of four GPU types; some co-runners arrive.",
        epochs=4, steps_per_epoch=3, noise=0.02,
        events=[
            {"epoch": 1, "kind": "corunner", "ranks": list(range(0, 1024, 7)), "corunner": "video"},
            {"epoch": 2, "kind": "ramp", "ranks": list(range(3, 1024, 11)), "factor": 2.0, "epochs": 2},
        ],
    ),
}
