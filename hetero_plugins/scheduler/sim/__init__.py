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

from hetero_plugins.balancing.allocators import Allocator, equal_finish_time, get_allocator
from hetero_plugins.metrics import straggler_level
from hetero_plugins.balancing.planner import BalancePlanner

__all__ = [
    "BUILTIN_SCENARIOS",
    "ClusterSim",
    "DecisionProblem",
    "Scenario",
    "decision_problems",
    "best_placement",
    "load_scenario",
    "oracle",
    "simulate",
]

EVENT_KINDS = ("speed", "ramp", "corunner", "lost")

_SCHEMA_HINT = (
    'a scenario is {"ranks": [{"device": "a100", "corunner": null}, ...], "devices": {"a100": {"cost_per_sample": '
    '0.001, "overhead": 0.01, "memory_samples": 512}}, "free_slots"?: [{"device", "corunner"}], "global_batch": 1024, '
    '"epochs"?: 20, "noise"?: 0.05, "events"?: [{"epoch": 5, "rank": 3, "corunner": "memcpy"}], "seed"?: 0} '
    "(see docs/scheduler.md)"
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
        join: epoch at which each rank joins (0: from the start; later: a rank added by an event).
        leave: epoch from which each rank is lost (``None``: never).
        allreduce: ``(latency s, gradient bytes, bandwidth bytes/s)`` of the ring all-reduce added to every step,
            ``latency + 2(n-1)/n * bytes / bandwidth`` for ``n`` active ranks (zeros: no communication cost).
        free_slots: idle places a rank could be relocated to, each ``{"device", "corunner", "data"}``.
        restart_cost: seconds a relocation restart costs (checkpoint, relaunch, reload), charged to the epoch
            after a policy relocates ranks (:func:`simulate` with ``relocation``).
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
    join: tuple[int, ...] = ()
    leave: tuple[int | None, ...] = ()
    allreduce: tuple[float, float, float] = (0.0, 0.0, 0.0)
    free_slots: tuple[dict[str, Any], ...] = ()
    restart_cost: float = 0.2

    @property
    def world_size(self) -> int:
        """Ranks ever present (those that join later and those lost included); see :meth:`ClusterSim.active`."""
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


#: Slowdown of any device beside these co-runners when a scenario gives no ``interference`` table.
#: It is the simulator's hidden truth: policies see only the times it produces.
DEFAULT_CORUNNERS: dict[str, float] = {"memcpy": 1.4, "video": 1.5, "inference": 1.3, "etl": 1.2, "training": 1.6}

SCENARIO_FIELDS = ("name", "description", "workload", "ranks", "devices", "free_slots", "global_batch", "epochs",
                   "steps_per_epoch", "noise", "events", "seed", "interference", "allreduce", "restart_cost")
_EVENT_HINT = ('use {"epoch": e, "rank": r (or "ranks": [r, ...]), ...} with one of "corunner": name or null '
               '(arrives / leaves), "speed": factor (time multiplier), "ramp": factor with "over": epochs, "lost": true, '
               'or {"epoch": e, "add": {"device": name, "corunner": null}} (a rank joins).')


def _parse(spec: dict[str, Any], default_name: str) -> Scenario:
    """Validate a scenario in the issue's JSON schema (see :func:`load_scenario`) and build the :class:`Scenario`."""
    for key in spec:
        if key == "device_types":
            raise _err(key, "...", 'the older internal form is not supported; use "devices": {name: {"cost_per_sample": '
                       's, "overhead": s, "memory_samples": n}} (slope -> cost_per_sample, intercept -> overhead, '
                       "max_batch -> memory_samples; see docs/scheduler.md).")
        if key not in SCENARIO_FIELDS:
            raise _err(key, spec[key], f"remove it; known fields are {sorted(SCENARIO_FIELDS)}.")
    for key in ("ranks", "devices", "global_batch"):
        if key not in spec:
            raise ValueError(f"scenario field `{key}` is missing. HINT: {_SCHEMA_HINT}")
    name = spec.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise _err("name", name, "use a non-empty string.")
    # ---- devices: (overhead, cost per sample, memory cap)
    devices = spec["devices"]
    if not isinstance(devices, dict) or not devices:
        raise _err("devices", devices, 'give at least one device, e.g. {"a100": {"cost_per_sample": 0.001, '
                   '"overhead": 0.01, "memory_samples": 512}}.')
    types: dict[str, tuple[float, float, int | None]] = {}
    for d, t in devices.items():
        f = f"devices.{d}"
        if not isinstance(t, dict):
            raise _err(f, t, 'use {"cost_per_sample": seconds, "overhead": seconds per step, "memory_samples": n}.')
        for k in t:
            if k not in ("cost_per_sample", "overhead", "memory_samples"):
                raise _err(f"{f}.{k}", t[k], "remove it; a device has cost_per_sample, overhead and memory_samples.")
        if "cost_per_sample" not in t:
            raise ValueError(f"scenario field `{f}.cost_per_sample` is missing. HINT: give seconds per sample, e.g. 0.001.")
        mb = t.get("memory_samples")
        types[d] = (float(_num(f"{f}.overhead", t.get("overhead", 0.0))),
                    float(_num(f"{f}.cost_per_sample", t["cost_per_sample"], strict=True)),
                    None if mb is None else _num(f"{f}.memory_samples", mb, minimum=1, integer=True))
    # ---- interference: the hidden slowdown table {corunner: {device: factor}}
    table = spec.get("interference")
    interference: dict[str, dict[str, float]] = {}
    if table is None:
        interference = {c: {d: v for d in types} for c, v in DEFAULT_CORUNNERS.items()}
    elif isinstance(table, dict):
        for c, row in table.items():
            if isinstance(row, (int, float)) and not isinstance(row, bool):
                interference[c] = {d: float(_num(f"interference.{c}", row, minimum=1.0)) for d in types}
            elif isinstance(row, dict):
                for d, v in row.items():
                    if d not in types:
                        raise _err(f"interference.{c}.{d}", d, f"use one of the devices {sorted(types)}.")
                interference[c] = {d: float(_num(f"interference.{c}.{d}", v, minimum=1.0)) for d, v in row.items()}
            else:
                raise _err(f"interference.{c}", row, 'use a factor >= 1 or {"device": factor >= 1}.')
    else:
        raise _err("interference", table, 'use {"corunner": slowdown} or {"corunner": {"device": slowdown}}.')

    def corunner(field: str, c: Any) -> Any:
        if c is not None and c not in interference:
            raise _err(field, c, f"use null or a co-runner of the interference model {sorted(interference)} "
                       "(or add it to `interference`).")
        return c

    def rank_data(field: str, v: Any) -> float:
        return float(_num(field, v))

    # ---- ranks present from epoch 0 (``count`` repeats an entry)
    ranks = spec["ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise _err("ranks", ranks, 'give a list of ranks, e.g. [{"device": "a100", "corunner": null}].')
    device: list[str] = []
    data: list[float] = []
    join: list[int] = []
    parsed_events: list[dict[str, Any]] = []
    for i, r in enumerate(ranks):
        f = f"ranks[{i}]"
        if not isinstance(r, dict) or "device" not in r:
            raise _err(f, r, 'use {"device": <a name from devices>, "corunner": null or a name}.')
        for k in r:
            if k not in ("device", "corunner", "data", "count"):
                raise _err(f"{f}.{k}", r[k], "remove it; a rank has device, corunner, data (and count).")
        if r["device"] not in types:
            raise _err(f"{f}.device", r["device"], f"use one of the devices {sorted(types)}.")
        count = _num(f"{f}.count", r.get("count", 1), minimum=1, integer=True)
        c = corunner(f"{f}.corunner", r.get("corunner"))
        if c is not None:
            parsed_events.append({"epoch": 0, "kind": "corunner", "ranks": list(range(len(device), len(device) + count)),
                                  "corunner": c})
        device += [r["device"]] * count
        data += [rank_data(f"{f}.data", r.get("data", 0.0))] * count
        join += [0] * count
    # ---- events (ranks added by earlier events count after the listed ones)
    events = spec.get("events", [])
    if not isinstance(events, list):
        raise _err("events", events, _EVENT_HINT)
    leave: list[int | None] = [None] * len(device)
    for k, ev in enumerate(events):
        f = f"events[{k}]"
        if not isinstance(ev, dict) or "epoch" not in ev:
            raise _err(f, ev, _EVENT_HINT)
        epoch = _num(f"{f}.epoch", ev["epoch"], minimum=0, integer=True)
        actions = [a for a in ("corunner", "speed", "ramp", "lost", "add") if a in ev]
        extra = set(ev) - {"epoch", "rank", "ranks", "over", *actions}
        if len(actions) != 1 or extra:
            raise _err(f, ev, _EVENT_HINT)
        act = actions[0]
        if act == "add":
            a = ev["add"]
            if not isinstance(a, dict) or "device" not in a or set(a) - {"device", "corunner", "data"}:
                raise _err(f"{f}.add", a, 'use {"device": <a name from devices>, "corunner": null or a name}.')
            if a["device"] not in types:
                raise _err(f"{f}.add.device", a["device"], f"use one of the devices {sorted(types)}.")
            c = corunner(f"{f}.add.corunner", a.get("corunner"))
            if c is not None:
                parsed_events.append({"epoch": epoch, "kind": "corunner", "ranks": [len(device)], "corunner": c})
            device.append(a["device"])
            data.append(rank_data(f"{f}.add.data", a.get("data", 0.0)))
            join.append(epoch)
            leave.append(None)
            continue
        n = len(device)
        rs = ev["ranks"] if "ranks" in ev else [ev.get("rank")]
        field = f"{f}.ranks" if "ranks" in ev else f"{f}.rank"
        if not isinstance(rs, list) or not rs or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n for r in rs):
            raise _err(field, ev.get("ranks", ev.get("rank")), f"use a rank index in [0, {n - 1}] (ranks added by earlier "
                       "events count after the listed ones).")
        rs = list(rs)
        if act == "corunner":
            parsed_events.append({"epoch": epoch, "kind": "corunner", "ranks": rs,
                                  "corunner": corunner(f"{f}.corunner", ev["corunner"])})
        elif act == "speed":
            parsed_events.append({"epoch": epoch, "kind": "speed", "ranks": rs,
                                  "factor": float(_num(f"{f}.speed", ev["speed"], strict=True))})
        elif act == "ramp":
            parsed_events.append({"epoch": epoch, "kind": "ramp", "ranks": rs,
                                  "factor": float(_num(f"{f}.ramp", ev["ramp"], strict=True)),
                                  "epochs": _num(f"{f}.over", ev.get("over", 1), minimum=1, integer=True)})
        else:
            if ev["lost"] is not True:
                raise _err(f"{f}.lost", ev["lost"], "use true (the rank is lost from this epoch on).")
            for r in rs:
                leave[r] = epoch if leave[r] is None else min(leave[r], epoch)  # type: ignore[type-var]
            parsed_events.append({"epoch": epoch, "kind": "lost", "ranks": rs})
    parsed_events.sort(key=lambda ev: ev["epoch"])  # stable: same-epoch events keep the file's order
    # ---- job
    epochs = _num("epochs", spec.get("epochs", 10), minimum=1, integer=True)
    gb = _num("global_batch", spec["global_batch"], minimum=1, integer=True)
    caps = [types[d][2] for d in device]
    for e in sorted({0, *join, *(x for x in leave if x is not None)}):
        if e >= epochs:
            continue
        act_r = [r for r in range(len(device)) if join[r] <= e and (leave[r] is None or e < leave[r])]
        if not act_r:
            raise _err("events", events, f"every rank is lost by epoch {e}; keep at least one rank.")
        if len(act_r) > gb:
            raise _err("global_batch", gb, f"{len(act_r)} ranks are active in epoch {e}; use a global_batch >= {len(act_r)}.")
        act_caps = [caps[r] for r in act_r]
        if all(c is not None for c in act_caps) and sum(act_caps) < gb:  # type: ignore[arg-type]
            raise _err("global_batch", gb, f"the memory_samples of the ranks active in epoch {e} sum to "
                       f"{sum(act_caps)}; lower global_batch or raise memory_samples.")  # type: ignore[arg-type]
    workload = spec.get("workload", "training")
    if not isinstance(workload, str) or not workload:
        raise _err("workload", workload, "use a string such as 'resnet' or 'training'.")
    allreduce = spec.get("allreduce")
    ar = (0.0, 0.0, 0.0)
    if allreduce is not None:
        if not isinstance(allreduce, dict) or set(allreduce) - {"latency", "bytes", "bandwidth"}:
            raise _err("allreduce", allreduce, 'use {"latency": seconds, "bytes": gradient bytes, "bandwidth": bytes per second}.')
        ar = (float(_num("allreduce.latency", allreduce.get("latency", 0.0))),
              float(_num("allreduce.bytes", allreduce.get("bytes", 0.0))),
              float(_num("allreduce.bandwidth", allreduce.get("bandwidth", 1e10), strict=True)))
    slots = spec.get("free_slots", [])
    if not isinstance(slots, list):
        raise _err("free_slots", slots, 'use a list of {"device": <a name from devices>, "corunner": null or a name}.')
    parsed_slots = []
    for k, slot in enumerate(slots):
        f = f"free_slots[{k}]"
        if not isinstance(slot, dict) or "device" not in slot or set(slot) - {"device", "corunner", "data"}:
            raise _err(f, slot, 'use {"device": <a name from devices>, "corunner": null or a name, "data": seconds (optional)}.')
        if slot["device"] not in types:
            raise _err(f"{f}.device", slot["device"], f"use one of the devices {sorted(types)}.")
        parsed_slots.append({"device": slot["device"], "corunner": corunner(f"{f}.corunner", slot.get("corunner")),
                             "data": rank_data(f"{f}.data", slot.get("data", 0.0))})
    return Scenario(
        name=name,
        global_batch=gb,
        device=tuple(device),
        intercept=tuple(types[d][0] for d in device),
        slope=tuple(types[d][1] for d in device),
        max_batch=tuple(caps),
        data=tuple(data),
        events=tuple(parsed_events),
        interference=interference,
        workload=workload,
        epochs=epochs,
        steps_per_epoch=_num("steps_per_epoch", spec.get("steps_per_epoch", 20), minimum=1, integer=True),
        noise=float(_num("noise", spec.get("noise", 0.02))),
        seed=_num("seed", spec.get("seed", 0), minimum=0, integer=True),
        join=tuple(join),
        leave=tuple(leave),
        allreduce=ar,
        free_slots=tuple(parsed_slots),
        restart_cost=float(_num("restart_cost", spec.get("restart_cost", 0.2))),
    )


def load_scenario(source: Scenario | str | Path | Mapping[str, Any]) -> Scenario:
    """Validate a scenario given as a built-in name, a JSON file path or a dict (a :class:`Scenario` passes through).

    The schema is the issue's (documented in docs/scheduler.md): ``ranks`` (``device``, ``corunner``, ``data``,
    ``count``), ``devices`` (``cost_per_sample``, ``overhead``, ``memory_samples``), ``global_batch`` and the
    optional ``free_slots``, ``epochs``, ``steps_per_epoch``, ``noise``, ``seed``, ``allreduce``,
    ``interference``, ``events``, ``name``, ``workload``, ``description``.

    Raises:
        ValueError: naming the offending field, the value and the fix.

    Example::

        >>> load_scenario({"global_batch": 8, "devices": {"g": {"cost_per_sample": 0.001}},
        ...                "ranks": [{"device": "g", "count": 2}]}).world_size
        2
        >>> load_scenario({"global_batch": 8, "devices": {}, "ranks": []})
        Traceback (most recent call last):
        ...
        ValueError: scenario field `devices` is invalid: got {}. HINT: give at least one device, e.g. {"a100": {"cost_per_sample": 0.001, "overhead": 0.01, "memory_samples": 512}}.
    """
    if isinstance(source, Scenario):
        return source
    default = "scenario"
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
        default = path.stem
    elif isinstance(source, str):
        spec = copy.deepcopy(BUILTIN_SCENARIOS[source])
        default = source
    else:
        spec = copy.deepcopy(dict(source))
    if not isinstance(spec, dict):
        raise ValueError(f"a scenario must be a JSON object, got {type(spec).__name__}. HINT: {_SCHEMA_HINT}")
    return _parse(spec, default)


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
            if ev["epoch"] > epoch or ev["kind"] == "lost":
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

    def active(self, epoch: int) -> np.ndarray:
        """Indices of the ranks present in ``epoch`` (ranks join / are lost through events)."""
        sc = self.scenario
        if not sc.join:
            return np.arange(self.world_size)
        return np.array([r for r in range(self.world_size)
                         if sc.join[r] <= epoch and (sc.leave[r] is None or epoch < sc.leave[r])], dtype=np.int64)

    def allreduce_time(self, n: int) -> float:
        """Ring all-reduce seconds per step for ``n`` ranks: ``latency + 2(n-1)/n * bytes / bandwidth``."""
        latency, nbytes, bandwidth = self.scenario.allreduce
        if n <= 1 or (latency == 0 and nbytes == 0):
            return 0.0
        return float(latency + 2.0 * (n - 1) / n * nbytes / bandwidth)

    def step_times(self, epoch: int, step: int, plan: Sequence[int],
                   ranks: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(compute, data)`` seconds of ``ranks`` (default: all) for one step under ``plan``; monotone in each batch size."""
        a, beta, data = self.params(epoch)
        noise = self._noise(epoch, step)
        if ranks is not None:
            idx = np.asarray(ranks, dtype=np.int64)
            a, beta, data, noise = a[idx], beta[idx], data[idx], noise[idx]
        compute = (a + beta * np.asarray(plan, dtype=np.float64)) * noise
        return compute, data

    def slots(self, epoch: int) -> list[dict[str, Any]]:
        """Every place a rank could run in ``epoch``: the active ranks' own (first) and the free slots, each
        ``{"device", "corunner", "data", "intercept", "slope", "max_batch", "rank"}`` with the *true* times."""
        sc = self.scenario
        a, beta, data = self.params(epoch)
        co = self.corunners(epoch)
        out = [{"device": sc.device[r], "corunner": co[r], "data": float(data[r]), "intercept": float(a[r]),
                "slope": float(beta[r]), "max_batch": sc.max_batch[r], "rank": int(r)} for r in self.active(epoch)]
        types = {d: (i, b, m) for d, i, b, m in zip(sc.device, sc.intercept, sc.slope, sc.max_batch)}
        for k, slot in enumerate(sc.free_slots):
            i, b, m = types[slot["device"]]
            f = sc.interference[slot["corunner"]].get(slot["device"], 1.0) if slot["corunner"] else 1.0
            out.append({"device": slot["device"], "corunner": slot["corunner"], "data": slot["data"],
                        "intercept": i * f, "slope": b * f, "max_batch": m, "rank": None, "free_slot": k})
        return out

    def slot_noise(self, epoch: int, step: int, slots: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """The step noise of each slot (a rank's own, or a free slot's own stream)."""
        own = self._noise(epoch, step)
        free = None
        out = np.ones(len(slots))
        for k, slot in enumerate(slots):
            if slot.get("rank") is not None:
                out[k] = own[slot["rank"]]
            elif self.scenario.noise > 0:
                if free is None:
                    rng = np.random.default_rng([self.seed, epoch, step, 1])
                    free = np.exp(rng.normal(0.0, self.scenario.noise, len(self.scenario.free_slots)))
                out[k] = free[slot["free_slot"]]
        return out

    @property
    def places(self) -> int:
        """Places a rank can run on: each rank's own (indices ``0..world_size-1``) then the free slots."""
        return self.world_size + len(self.scenario.free_slots)

    def place_devices(self) -> list[str]:
        """Device type of every place."""
        return list(self.scenario.device) + [s["device"] for s in self.scenario.free_slots]

    def place_caps(self) -> list[int | None]:
        """Memory cap (largest local batch) of every place."""
        sc = self.scenario
        types = dict(zip(sc.device, sc.max_batch))
        return list(sc.max_batch) + [types.get(s["device"]) for s in sc.free_slots]

    def place_corunners(self, epoch: int) -> list[str | None]:
        """The co-runner of every place in ``epoch`` (a free slot's is fixed)."""
        return self.corunners(epoch) + [s["corunner"] for s in self.scenario.free_slots]

    def place_multipliers(self, epoch: int) -> np.ndarray:
        """The time multiplier of every place in ``epoch`` (events apply to the place a rank started on)."""
        sc = self.scenario
        free = [sc.interference[s["corunner"]].get(s["device"], 1.0) if s["corunner"] else 1.0 for s in sc.free_slots]
        return np.concatenate([self.multipliers(epoch), np.asarray(free, dtype=np.float64)])

    def place_params(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Noise-free ``(intercept, slope, data)`` of every place in ``epoch``."""
        sc = self.scenario
        types = {d: (i, b) for d, i, b in zip(sc.device, sc.intercept, sc.slope)}
        a0 = np.concatenate([self._a, [types[s["device"]][0] for s in sc.free_slots]])
        b0 = np.concatenate([self._beta, [types[s["device"]][1] for s in sc.free_slots]])
        data = np.concatenate([self._data, [s["data"] for s in sc.free_slots]])
        m = self.place_multipliers(epoch)
        return a0 * m, b0 * m, data

    def place_noise(self, epoch: int, step: int) -> np.ndarray:
        """The step noise of every place (the ranks' own streams, then the free slots' stream)."""
        own = self._noise(epoch, step)
        k = len(self.scenario.free_slots)
        if k == 0:
            return own
        if self.scenario.noise == 0:
            return np.ones(self.places)
        rng = np.random.default_rng([self.seed, epoch, step, 1])
        return np.concatenate([own, np.exp(rng.normal(0.0, self.scenario.noise, k))])

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
    relocation: Any = None,
) -> dict[str, Any]:
    """Run the balancing loop (:class:`~hetero_plugins.balancing.planner.BalancePlanner`) against the simulated cluster.

    Every epoch runs ``steps_per_epoch`` steps under the current plan; the planner observes the measured
    compute times (data time is outside its window, as in :class:`~hetero_plugins.callbacks.BatchBalancer`)
    and plans the next epoch. With ``telemetry``, allocators with a ``set_context`` method also get, before
    each decision, what a real scheduler can observe at that epoch boundary: per-rank ``utilisation`` by other
    processes and ``data`` seconds per step (both measured in the epoch just run), each rank's ``devices``
    type, the ``corunners`` it ran beside in that epoch and the ``next_corunners`` placed beside it for the
    next epoch (co-runner *identities*, as a cluster manager knows them; never their slowdowns, which stay
    hidden in the scenario's ``interference`` table). ``telemetry=False`` simulates a run that passes none.

    ``relocation`` (stage 2 applied; ``True`` for a default
    :class:`~hetero_plugins.scheduler.relocation.Relocator` with the scenario's ``restart_cost``, or a
    ``Relocator``): at each epoch boundary the relocator may move ranks to free places (the free slots, and
    places that relocated ranks left); the moved ranks start the next epoch from the NCF-predicted time line
    of their new place, that epoch pays ``restart_cost`` seconds, and a rank that joins starts from the
    NCF-predicted line of its device instead of a survivor's. Events (co-runners, speed changes, ramps) belong
    to places: a rank that leaves a place leaves its co-runner behind.

    Ranks lost or added by events restart the planner at the epoch boundary (survivors keep their time
    models). Every step also pays the scenario's ring all-reduce time. The planner's damping gate
    (``min_gain``) uses the allocator's ``predict_makespan`` where it has one (see
    :meth:`~hetero_plugins.balancing.planner.BalancePlanner.predict_step_time`).

    Returns:
        dict with ``epoch_times`` (seconds), ``total_time``, ``samples_per_s``, ``steady_samples_per_s``
        (epochs after the first), ``plans``, ``straggler_level`` per epoch, ``world_sizes``, ``restarts``,
        ``relocations`` (per relocation: epoch and moves), ``placements`` (each rank's place per epoch) and
        ``decision_ms`` (mean wall time of one planning call).
    """
    import time

    sim = ClusterSim(scenario, seed=seed)
    sc = sim.scenario
    epochs = sc.epochs if epochs is None else int(epochs)
    alloc = get_allocator(allocator) if isinstance(allocator, str) else allocator
    context = telemetry and hasattr(alloc, "set_context")
    relocator = relocation
    if relocation is True:
        from hetero_plugins.scheduler.relocation import Relocator

        relocator = Relocator(workload=sc.workload, restart_cost=sc.restart_cost)
    elif relocation is False:
        relocator = None
    pdev, pcaps = sim.place_devices(), sim.place_caps()
    where: dict[int, int] = {}  # rank -> place
    planner: BalancePlanner | None = None
    members: np.ndarray | None = None
    measured_co: dict[int, str | None] = {}  # co-runner under which each rank's time model was measured
    measured_data: dict[int, float] = {}
    epoch_times, plans, levels, decide, worlds, placements = [], [], [], [], [], []
    moves_log: list[dict[str, Any]] = []
    restarts = 0
    pending_cost = 0.0

    def predicted_line(place: int, epoch: int) -> tuple[float, float] | None:
        """A new rank's time line: the NCF-predicted line of its place (None: unknown)."""
        if relocator is None or planner is None or members is None:
            return None
        lines = [(p.intercept, p.slope) for p in planner.model_params()]
        solo = relocator.solo_lines([pdev[where[int(r)]] for r in members],
                                    [measured_co.get(int(r)) for r in members], lines, sc.workload)
        s = relocator.slowdown(pdev[place], sim.place_corunners(epoch)[place], sc.workload)
        if pdev[place] not in solo or s is None:
            return None
        a, b = solo[pdev[place]]
        return a * s, b * s

    for e in range(epochs):
        act = sim.active(e)
        if members is None or not np.array_equal(act, members):
            # A rank was lost or added: an elastic restart at the epoch boundary. Survivors keep their time
            # models and places; a new rank takes its own place and starts from the NCF-predicted line of it
            # (with a relocator) or a survivor's of the same device type, and the first plan is decided from
            # those models when every rank has one.
            new = BalancePlanner(len(act), sc.global_batch, allocator=alloc, min_gain=min_gain)
            for r in act:
                where.setdefault(int(r), int(r))
            if planner is not None and members is not None:
                restarts += 1
                old = {int(r): m for r, m in zip(members, planner.models)}
                source: list[int | None] = []
                for i, r in enumerate(act):
                    r = int(r)
                    if r in old:
                        q: int | None = r
                    else:
                        predicted = predicted_line(where[r], e)
                        if predicted is not None:
                            new.seed_model(i, predicted, sc.global_batch // len(act))
                            measured_co[r] = sim.place_corunners(e)[where[r]]
                            source.append(r)
                            continue
                        q = next((q for q in old if pdev[where[q]] == pdev[where[r]]), None)
                    source.append(q)
                    if q is not None:
                        new.models[i] = copy.deepcopy(old[q])
                new.memory_caps = [pcaps[where[int(r)]] for r in act]
                new._observed_steps = new.warmup_steps
                if all(p is not None for p in new.model_params()):
                    if context:
                        nxt = sim.place_corunners(e)
                        alloc.set_context(  # type: ignore[union-attr]
                            utilisation=None,
                            data=[measured_data.get(int(r), measured_data.get(q, 0.0) if q is not None else 0.0)
                                  for r, q in zip(act, source)],
                            devices=[pdev[where[int(r)]] for r in act],
                            corunners=[measured_co.get(q) if q is not None else None for q in source],
                            next_corunners=[nxt[where[int(r)]] for r in act], workload=sc.workload)
                    new.replan()
            planner, members = new, act
        assert planner is not None
        here = np.array([where[int(r)] for r in act], dtype=np.int64)
        caps = [pcaps[p] for p in here]
        comm = sim.allreduce_time(len(act))
        plan = list(planner.plan)
        plans.append(plan)
        worlds.append(len(act))
        placements.append([int(p) for p in here])
        a_p, b_p, d_p = sim.place_params(e)
        records = np.zeros((len(act), sc.steps_per_epoch, 3))
        total, pending_cost = pending_cost, 0.0
        planv = np.asarray(plan, dtype=np.float64)
        for s in range(sc.steps_per_epoch):
            compute = (a_p[here] + b_p[here] * planv) * sim.place_noise(e, s)[here]
            data = d_p[here]
            records[:, s, 0] = plan
            records[:, s, 1] = compute
            records[:, s, 2] = data
            total += float(np.max(compute + data)) + comm
        epoch_times.append(total)
        levels.append(straggler_level(records[:, :, 1].mean(axis=1) + records[:, :, 2].mean(axis=1)))
        co_now, co_next = sim.place_corunners(e), sim.place_corunners(e + 1)
        measured_co = {int(r): co_now[p] for r, p in zip(act, here)}
        measured_data = {int(r): float(d) for r, d in zip(act, records[:, :, 2].mean(axis=1))}
        if context:
            mult = sim.place_multipliers(e)[here]
            alloc.set_context(utilisation=list(1.0 - 1.0 / mult), data=list(records[:, :, 2].mean(axis=1)),  # type: ignore[union-attr]
                              devices=[pdev[p] for p in here], corunners=[co_now[p] for p in here],
                              next_corunners=[co_next[p] for p in here], workload=sc.workload)
        t0 = time.perf_counter()
        planner.end_epoch(e, records, epoch_time=total, memory_caps=caps)
        decide.append(time.perf_counter() - t0)
        if relocator is not None and e + 1 < epochs and np.array_equal(sim.active(e + 1), act) \
                and all(p is not None for p in planner.model_params()):
            taken = set(where[int(r)] for r in act)
            alive = set(int(r) for r in act)
            free = [p for p in range(sim.places) if p not in taken and (p >= sim.world_size or p in alive)]
            if free:
                t0 = time.perf_counter()
                decision = relocator.propose(
                    devices=[pdev[p] for p in here], corunners=[co_now[p] for p in here],
                    next_corunners=[co_next[p] for p in here],
                    lines=[(m.intercept, m.slope) for m in planner.model_params()],
                    free_slots=[{"device": pdev[p], "corunner": co_next[p], "data": float(d_p[p])} for p in free],
                    global_batch=sc.global_batch, steps_per_epoch=sc.steps_per_epoch, epochs_left=epochs - e - 1,
                    data=list(records[:, :, 2].mean(axis=1)), workload=sc.workload)
                if decision.moves:
                    for i, k in decision.moves:
                        r, p = int(act[i]), free[k]
                        where[r] = p
                        planner.seed_model(i, decision.lines[i])
                        measured_co[r] = co_next[p]
                    here = np.array([where[int(r)] for r in act], dtype=np.int64)
                    planner.memory_caps = [pcaps[p] for p in here]
                    if context:
                        alloc.set_context(utilisation=None, data=[float(d_p[p]) for p in here],  # type: ignore[union-attr]
                                          devices=[pdev[p] for p in here], corunners=[co_next[p] for p in here],
                                          next_corunners=[co_next[p] for p in here], workload=sc.workload)
                    planner.replan()
                    pending_cost = sc.restart_cost
                    moves_log.append({"epoch": e + 1, "moves": [(int(act[i]), int(free[k])) for i, k in decision.moves],
                                      "predicted_gain": decision.predicted_gain})
                decide[-1] += time.perf_counter() - t0
    samples = sc.global_batch * sc.steps_per_epoch * epochs
    return {
        "scenario": sc.name,
        "allocator": getattr(alloc, "name", type(alloc).__name__),
        "steady_samples_per_s": _steady(sc, epoch_times),
        "world_size": sc.world_size,
        "world_sizes": worlds,
        "restarts": restarts,
        "relocations": moves_log,
        "placements": placements,
        "epochs": epochs,
        "epoch_times": epoch_times,
        "total_time": float(sum(epoch_times)),
        "samples_per_s": samples / float(sum(epoch_times)),
        "straggler_level": levels,
        "plans": plans,
        "decision_ms": 1000.0 * float(np.mean(decide)),
    }


def _steady(sc: Scenario, epoch_times: Sequence[float]) -> float:
    """Samples per second after the first epoch (the one every policy spends measuring an equal split)."""
    rest = list(epoch_times[1:]) or list(epoch_times)
    return sc.global_batch * sc.steps_per_epoch * len(rest) / float(sum(rest))


def best_placement(slots: Sequence[Mapping[str, Any]], n: int, global_batch: int) -> list[int]:
    """Indices of the ``n`` slots with the shortest equal-finish step time (true times, data included).

    Greedy on speed (``1/slope``, the exact optimum when fixed costs are negligible), then single swaps with
    the unchosen slots while the exact continuous equal-finish time ``(B + sum c/s) / sum 1/s`` improves
    (``c``: fixed cost plus data time, ``s``: slope).
    """
    c = np.array([float(x["intercept"]) + float(x["data"]) for x in slots])
    sl = np.array([float(x["slope"]) for x in slots])
    order = sorted(range(len(slots)), key=lambda k: (sl[k], slots[k].get("rank") is None, k))
    chosen = order[:n]
    rest = order[n:]

    def t(ix: list[int]) -> float:
        return equal_finish_time(c[ix], sl[ix], global_batch)

    best = t(chosen)
    improved = bool(rest)
    while improved:
        improved = False
        for i in range(len(chosen)):
            for j in range(len(rest)):
                cand = chosen[:i] + [rest[j]] + chosen[i + 1:]
                v = t(cand)
                if v < best * (1 - 1e-9):
                    rest[j], chosen = chosen[i], cand
                    best, improved = v, True
    return sorted(chosen)


def oracle(
    scenario: Scenario | str | Path | Mapping[str, Any],
    epochs: int | None = None,
    seed: int | None = None,
    placement: bool = True,
) -> dict[str, Any]:
    """The oracle: every epoch, the best placement (over the ranks' own and the free slots) and the
    equal-finish split on the *true* times (data time included, memory caps respected), run under the same
    noise as :func:`simulate`. Returns ``epoch_times``, ``total_time``, ``samples_per_s``, ``plans`` and
    ``placements`` (slot descriptions per epoch)."""
    from hetero_plugins.balancing.allocators import Bounds, EqualFinishAllocator
    from hetero_plugins.balancing.time_model import TimeModelParams

    sim = ClusterSim(scenario, seed=seed)
    sc = sim.scenario
    epochs = sc.epochs if epochs is None else int(epochs)
    ef = EqualFinishAllocator()
    times, plans, placements = [], [], []
    for e in range(epochs):
        slots = sim.slots(e)
        n = len(sim.active(e))
        pick = best_placement(slots, n, sc.global_batch) if placement and len(slots) > n else list(range(n))
        chosen = [slots[k] for k in pick]
        models = [TimeModelParams(x["intercept"] + x["data"], x["slope"]) for x in chosen]
        bounds = Bounds((1,) * n, tuple(sc.global_batch if x["max_batch"] is None else int(x["max_batch"]) for x in chosen))
        plan = np.asarray(ef.allocate(models, sc.global_batch, bounds), dtype=np.float64)
        a = np.array([x["intercept"] for x in chosen])
        beta = np.array([x["slope"] for x in chosen])
        data = np.array([x["data"] for x in chosen])
        comm = sim.allreduce_time(n)
        total = sum(float(np.max((a + beta * plan) * sim.slot_noise(e, s, chosen) + data)) + comm
                    for s in range(sc.steps_per_epoch))
        times.append(total)
        plans.append([int(b) for b in plan])
        placements.append([{"device": x["device"], "corunner": x["corunner"], "rank": x["rank"],
                            "free_slot": x.get("free_slot")} for x in chosen])
    samples = sc.global_batch * sc.steps_per_epoch * epochs
    return {"scenario": sc.name, "allocator": "oracle", "epochs": epochs, "epoch_times": times,
            "steady_samples_per_s": _steady(sc, times),
            "total_time": float(sum(times)), "samples_per_s": samples / float(sum(times)), "plans": plans,
            "placements": placements}


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

    def true_step_time(self, plan: Sequence[float]) -> float:
        """The next epoch's true step time (slowest rank, data time included) under ``plan``."""
        return float(np.max(self.true_intercept + self.true_slope * np.asarray(plan, dtype=np.float64) + self.true_data))


def decision_problems(
    scenario: Scenario | str | Path | Mapping[str, Any],
    rng: np.random.Generator,
    fit_noise: float = 0.03,
) -> list[DecisionProblem]:
    """One :class:`DecisionProblem` per epoch boundary of a scenario (epoch e observed, epoch e+1 true)."""
    sim = ClusterSim(scenario)
    sc = sim.scenario
    all_caps = np.array([c if c is not None else sc.global_batch for c in sc.max_batch], dtype=np.float64)
    out = []
    prev_beta = None
    for e in range(sc.epochs - 1):
        act = sim.active(e)
        if not np.array_equal(act, sim.active(e + 1)):  # membership changes: a restart, no decision to learn
            prev_beta = None
            continue
        a, beta, data = (x[act] for x in sim.params(e))
        a2, beta2, data2 = (x[act] for x in sim.params(e + 1))
        m = sim.multipliers(e)[act]
        caps = all_caps[act]
        jitter = np.exp(rng.normal(0.0, fit_noise, len(act)))
        obs_beta = beta * jitter
        if prev_beta is not None and len(prev_beta) != len(obs_beta):
            prev_beta = None
        out.append(DecisionProblem(
            intercept=a * jitter, slope=obs_beta, prev_slope=obs_beta if prev_beta is None else prev_beta,
            utilisation=1.0 - 1.0 / m, data=data, true_intercept=a2, true_slope=beta2, true_data=data2,
            global_batch=sc.global_batch, max_batch=caps,
        ))
        prev_beta = obs_beta
    return out


#: Device types of the built-in mixes: fixed seconds per step, seconds per sample, largest local batch.
_MIX_DEVICES: dict[str, dict[str, Any]] = {
    "a100": {"overhead": 0.004, "cost_per_sample": 0.00025, "memory_samples": 1024},
    "v100": {"overhead": 0.005, "cost_per_sample": 0.0005, "memory_samples": 512},
    "t4": {"overhead": 0.006, "cost_per_sample": 0.0012, "memory_samples": 256},
    "k80": {"overhead": 0.008, "cost_per_sample": 0.0025, "memory_samples": 256},
    "cpu": {"overhead": 0.010, "cost_per_sample": 0.0060, "memory_samples": 512},
}


def _mix(name: str, groups: list[tuple[str, int, float]], gb: int, **extra: Any) -> dict[str, Any]:
    """A built-in scenario in the issue's schema: ``groups`` of ``(device, count, data seconds)``."""
    spec = {
        "name": name,
        "global_batch": gb,
        "workload": "training",
        "devices": copy.deepcopy(_MIX_DEVICES),
        "ranks": [{"device": d, "corunner": None, "count": n, "data": data} for d, n, data in groups],
        # Ring all-reduce of ~2.5 M float32 gradients over a 5 GB/s network: ~4 ms per step at 8 ranks.
        "allreduce": {"latency": 0.0005, "bytes": 1.0e7, "bandwidth": 5.0e9},
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
    # An elastic cluster where a rank is lost and another joins (the default co-runner table).
    "elastic": {
        "name": "elastic",
        "description": "Elastic cluster: a co-runner arrives, a rank is lost, a rank joins.",
        "devices": {"a100": {"cost_per_sample": 0.00025, "overhead": 0.004, "memory_samples": 1024},
                    "v100": {"cost_per_sample": 0.0005, "overhead": 0.005, "memory_samples": 512},
                    "t4": {"cost_per_sample": 0.0012, "overhead": 0.006, "memory_samples": 256}},
        "ranks": [{"device": "a100", "corunner": None}, {"device": "a100", "corunner": None},
                  {"device": "v100", "corunner": None}, {"device": "v100", "corunner": "memcpy"},
                  {"device": "t4", "corunner": None}, {"device": "t4", "corunner": None}],
        "free_slots": [{"device": "v100", "corunner": None}],
        "global_batch": 768, "epochs": 12, "steps_per_epoch": 20, "noise": 0.02, "seed": 0,
        "allreduce": {"latency": 0.0005, "bytes": 1.0e7, "bandwidth": 5.0e9},
        "events": [{"epoch": 3, "rank": 4, "corunner": "video"}, {"epoch": 5, "rank": 1, "lost": True},
                   {"epoch": 8, "add": {"device": "v100", "corunner": None}},
                   {"epoch": 9, "rank": 3, "corunner": None}],
    },
    "paper_mix": _mix(
        "paper_mix", [("v100", 2, 0.0), ("t4", 2, 0.0), ("k80", 2, 0.0), ("cpu", 2, 0.0)], 512,
        description="CPU-GPU heterogeneous cluster (seed paper's setting, Zhang et al. TPDS 2021); one slowdown.",
        epochs=10, steps_per_epoch=20, noise=0.02,
        events=[{"epoch": 5, "ranks": [1], "speed": 1.6}],
    ),
    "static_mix": _mix(
        "static_mix", [("v100", 2, 0.0), ("t4", 2, 0.003), ("k80", 2, 0.0), ("cpu", 2, 0.0)], 512,
        description="A static CPU-GPU mix (no events); two ranks have a slow input pipeline.",
        epochs=8, steps_per_epoch=20, noise=0.02,
    ),
    "interference": _mix(
        "interference", [("v100", 4, 0.0), ("t4", 4, 0.0)], 512,
        description="Co-located streaming jobs arrive on and leave some GPUs (the IAWP stage's setting); "
                    "two idle GPUs could take relocated ranks.",
        epochs=10, steps_per_epoch=20, noise=0.02,
        free_slots=[{"device": "v100", "corunner": None}, {"device": "t4", "corunner": None}],
        events=[
            {"epoch": 2, "ranks": [0, 4], "corunner": "video"},
            {"epoch": 4, "ranks": [5], "corunner": "inference"},
            {"epoch": 6, "ranks": [0], "corunner": None},
            {"epoch": 7, "ranks": [2, 6], "corunner": "video"},
        ],
    ),
    "dynamic": _mix(
        "dynamic", [("v100", 4, 0.0), ("t4", 2, 0.004), ("k80", 2, 0.0)], 512,
        description="Non-dedicated nodes: background load ramps up, a node slows, two ranks have slow input pipelines.",
        epochs=12, steps_per_epoch=20, noise=0.02,
        events=[
            {"epoch": 1, "ranks": [0, 1], "ramp": 2.5, "over": 6},
            {"epoch": 3, "ranks": [6], "ramp": 2.0, "over": 5},
            {"epoch": 8, "ranks": [0, 1], "speed": 1.0},
        ],
    ),
    "large": _mix(
        "large", [("a100", 256, 0.0), ("v100", 256, 0.0), ("t4", 256, 0.0), ("k80", 256, 0.0)], 32768,
        description="1024 ranks of four GPU types; some co-runners arrive.",
        epochs=4, steps_per_epoch=3, noise=0.02,
        events=[
            {"epoch": 1, "ranks": list(range(0, 1024, 7)), "corunner": "video"},
            {"epoch": 2, "ranks": list(range(3, 1024, 11)), "ramp": 2.0, "over": 2},
        ],
    ),
}
