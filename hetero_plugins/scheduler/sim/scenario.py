"""The scenario schema of the simulator: :class:`Scenario`, :func:`load_scenario` and its checks per section."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.scheduler.sim.builtin import BUILTIN_SCENARIOS

__all__ = ["DEFAULT_CORUNNERS", "EVENT_KINDS", "SCENARIO_FIELDS", "DeviceType", "Scenario", "load_scenario"]

EVENT_KINDS = ("speed", "ramp", "corunner", "lost")

_SCHEMA_HINT = (
    'a scenario is {"ranks": [{"device": "a100", "corunner": null}, ...], "devices": {"a100": {"cost_per_sample": '
    '0.001, "overhead": 0.01, "memory_samples": 512}}, "free_slots"?: [{"device", "corunner"}], "global_batch": 1024, '
    '"epochs"?: 20, "noise"?: 0.05, "events"?: [{"epoch": 5, "rank": 3, "corunner": "memcpy"}], "seed"?: 0} '
    "(see docs/scheduler.md)"
)


@dataclass(frozen=True)
class DeviceType:
    """A device type's step-time curve: ``overhead + cost_per_sample * work(b)`` seconds for a local batch ``b``.

    ``work(b) = max(b, saturation) + (cliff_factor - 1) * max(0, b - cliff_at)``: below ``saturation`` samples
    the device is not saturated and a smaller batch takes no less time; beyond ``cliff_at`` samples (near the
    memory capacity) each further sample costs ``cliff_factor`` times as much. Both default to a linear line.

    Example::

        >>> curve = DeviceType(0.01, 0.001, 512, saturation=32, cliff_at=400, cliff_factor=3.0)
        >>> curve.work(np.array([8, 100, 410])).tolist()
        [32.0, 100.0, 430.0]
    """

    overhead: float
    cost_per_sample: float
    memory_samples: int | None = None
    saturation: int = 0
    cliff_at: int | None = None
    cliff_factor: float = 1.0

    @property
    def linear(self) -> bool:
        """Whether the curve is a plain line (no saturation, no cliff)."""
        return self.saturation == 0 and (self.cliff_at is None or self.cliff_factor == 1.0)

    def work(self, b: Any) -> np.ndarray:
        """Effective samples of local batches ``b`` (an array), so that time = overhead + cost * work(b)."""
        b = np.asarray(b, dtype=np.float64)
        w = np.maximum(b, float(self.saturation))
        if self.cliff_at is not None and self.cliff_factor != 1.0:
            w = w + (self.cliff_factor - 1.0) * np.maximum(0.0, b - float(self.cliff_at))
        return w


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
            after a policy relocates ranks (:func:`~hetero_plugins.scheduler.sim.simulate` with ``relocation``).
        device_types: every device type's curve by name (free slots may be of a type no rank starts on).
        slot_events: events on free slots, each ``{"epoch", "slot", "taken": bool}`` (another job takes the slot,
            or frees it) or ``{"epoch", "slot", "corunner": name or None}``, sorted by epoch.
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
    device_types: dict[str, DeviceType] = field(default_factory=dict)
    slot_events: tuple[dict[str, Any], ...] = ()

    @property
    def linear(self) -> bool:
        """Whether every device type's step time is linear in the batch size."""
        return all(t.linear for t in self.device_types.values())

    @property
    def world_size(self) -> int:
        """Ranks ever present (those that join later and those lost included); see
        :meth:`~hetero_plugins.scheduler.sim.ClusterSim.active`."""
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


def _noise(value: Any) -> float:
    """``noise``: the standard deviation of the log-normal step noise, in [0, 1] (beyond 1 a step's time spans
    orders of magnitude and every run's throughput collapses to nothing)."""
    v = float(_num("noise", value))
    if v > 1.0:
        raise _err("noise", value, "use a standard deviation in [0, 1], e.g. 0.05 (5% step-to-step noise).")
    return v


#: Slowdown of any device beside these co-runners when a scenario gives no ``interference`` table.
#: It is the simulator's hidden truth: policies see only the times it produces.
DEFAULT_CORUNNERS: dict[str, float] = {"memcpy": 1.4, "video": 1.5, "inference": 1.3, "etl": 1.2, "training": 1.6}

SCENARIO_FIELDS = ("name", "description", "workload", "ranks", "devices", "free_slots", "global_batch", "epochs",
                   "steps_per_epoch", "noise", "events", "seed", "interference", "allreduce", "restart_cost")
_EVENT_HINT = ('use {"epoch": e, "rank": r (or "ranks": [r, ...]), ...} with one of "corunner": name or null '
               '(arrives / leaves), "speed": factor (time multiplier), "ramp": factor with "over": epochs, "lost": true, '
               'or {"epoch": e, "add": {"device": name, "corunner": null}} (a rank joins), '
               'or {"epoch": e, "slot": k, "taken": true|false} / {"epoch": e, "slot": k, "corunner": name or null} '
               '(free slot k is taken by / freed from another job, or gets / loses a co-runner).')
_DEVICE_KEYS = ("cost_per_sample", "overhead", "memory_samples", "saturation", "cliff")

#: The device types by name.
_DeviceTypes = dict[str, DeviceType]
#: Checks a co-runner name against the interference table: ``corunner(field, name) -> name``.
_CorunnerCheck = Callable[[str, Any], Any]


@dataclass
class _Roster:
    """The ranks parsed so far: those of ``ranks``, then those added by events, with the events on them."""

    device: list[str] = field(default_factory=list)
    data: list[float] = field(default_factory=list)
    join: list[int] = field(default_factory=list)
    leave: list[int | None] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, epoch: int, device: str, corunner: Any, data: float, count: int = 1) -> None:
        """``count`` ranks of ``device`` joining at ``epoch``, beside ``corunner`` (an event at that epoch)."""
        if corunner is not None:
            self.events.append({"epoch": epoch, "kind": "corunner",
                                "ranks": list(range(len(self.device), len(self.device) + count)), "corunner": corunner})
        self.device += [device] * count
        self.data += [data] * count
        self.join += [epoch] * count
        self.leave += [None] * count


def _check_fields(spec: dict[str, Any], default_name: str) -> str:
    """Unknown and missing top-level fields; returns the scenario's name."""
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
    return name


def _parse_devices(spec: dict[str, Any]) -> _DeviceTypes:
    """``devices``: each type's overhead, cost per sample and memory cap."""
    devices = spec["devices"]
    if not isinstance(devices, dict) or not devices:
        raise _err("devices", devices, 'give at least one device, e.g. {"a100": {"cost_per_sample": 0.001, '
                   '"overhead": 0.01, "memory_samples": 512}}.')
    types: _DeviceTypes = {}
    for d, t in devices.items():
        f = f"devices.{d}"
        if not isinstance(t, dict):
            raise _err(f, t, 'use {"cost_per_sample": seconds, "overhead": seconds per step, "memory_samples": n}.')
        for k in t:
            if k not in _DEVICE_KEYS:
                raise _err(f"{f}.{k}", t[k], "remove it; a device has cost_per_sample, overhead, memory_samples "
                           "and optionally saturation and cliff.")
        if "cost_per_sample" not in t:
            raise ValueError(f"scenario field `{f}.cost_per_sample` is missing. HINT: give seconds per sample, e.g. 0.001.")
        mb = t.get("memory_samples")
        cliff = t.get("cliff")
        at, factor = None, 1.0
        if cliff is not None:
            if not isinstance(cliff, dict) or set(cliff) != {"at", "factor"}:
                raise _err(f"{f}.cliff", cliff, 'use {"at": samples, "factor": f >= 1} (each sample beyond `at` costs '
                           "f times as much) or leave it out.")
            at = _num(f"{f}.cliff.at", cliff["at"], minimum=1, integer=True)
            factor = float(_num(f"{f}.cliff.factor", cliff["factor"], minimum=1.0))
        types[d] = DeviceType(float(_num(f"{f}.overhead", t.get("overhead", 0.0))),
                              float(_num(f"{f}.cost_per_sample", t["cost_per_sample"], strict=True)),
                              None if mb is None else _num(f"{f}.memory_samples", mb, minimum=1, integer=True),
                              _num(f"{f}.saturation", t.get("saturation", 0), minimum=0, integer=True), at, factor)
    return types


def _parse_interference(spec: dict[str, Any], types: _DeviceTypes) -> dict[str, dict[str, float]]:
    """``interference``: the hidden slowdown table ``{corunner: {device: factor}}`` (default: DEFAULT_CORUNNERS)."""
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
    return interference


def _check_device(field: str, name: Any, types: _DeviceTypes) -> None:
    """``ValueError`` naming ``field`` unless ``name`` is one of the scenario's device types."""
    if not isinstance(name, str) or name not in types:
        kind = "" if isinstance(name, str) else "a device's name (a string), "
        raise _err(field, name, f"use {kind}one of the devices {sorted(types)}.")


def _corunner_check(interference: dict[str, dict[str, float]]) -> _CorunnerCheck:
    def corunner(field: str, c: Any) -> Any:
        if c is not None and not isinstance(c, str):
            raise _err(field, c, "use null or a co-runner's name (a string).")
        if c is not None and c not in interference:
            raise _err(field, c, f"use null or a co-runner of the interference model {sorted(interference)} "
                       "(or add it to `interference`).")
        return c

    return corunner


def _parse_ranks(spec: dict[str, Any], types: _DeviceTypes, corunner: _CorunnerCheck) -> _Roster:
    """``ranks``: the ranks present from epoch 0 (``count`` repeats an entry)."""
    ranks = spec["ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise _err("ranks", ranks, 'give a list of ranks, e.g. [{"device": "a100", "corunner": null}].')
    roster = _Roster()
    for i, r in enumerate(ranks):
        f = f"ranks[{i}]"
        if not isinstance(r, dict) or "device" not in r:
            raise _err(f, r, 'use {"device": <a name from devices>, "corunner": null or a name}.')
        for k in r:
            if k not in ("device", "corunner", "data", "count"):
                raise _err(f"{f}.{k}", r[k], "remove it; a rank has device, corunner, data (and count).")
        _check_device(f"{f}.device", r["device"], types)
        count = _num(f"{f}.count", r.get("count", 1), minimum=1, integer=True)
        c = corunner(f"{f}.corunner", r.get("corunner"))
        roster.add(0, r["device"], c, float(_num(f"{f}.data", r.get("data", 0.0))), count)
    return roster


def _parse_events(spec: dict[str, Any], types: _DeviceTypes, corunner: _CorunnerCheck, roster: _Roster) -> list[Any]:
    """``events``, in the roster (ranks added by earlier events count after the listed ones); returns the raw list."""
    events = spec.get("events", [])
    if not isinstance(events, list):
        raise _err("events", events, _EVENT_HINT)
    for k, ev in enumerate(events):
        f = f"events[{k}]"
        if not isinstance(ev, dict) or "epoch" not in ev:
            raise _err(f, ev, _EVENT_HINT)
        epoch = _num(f"{f}.epoch", ev["epoch"], minimum=0, integer=True)
        if "slot" in ev:  # checked with the free slots (see _parse_slot_events)
            continue
        actions = [a for a in ("corunner", "speed", "ramp", "lost", "add") if a in ev]
        extra = set(ev) - {"epoch", "rank", "ranks", "over", *actions}
        # one action; "over" only with a ramp; "rank" or "ranks", not both (one of them would be ignored)
        if len(actions) != 1 or extra or ("over" in ev and actions != ["ramp"]) or {"rank", "ranks"} <= set(ev):
            raise _err(f, ev, _EVENT_HINT)
        if actions[0] == "add":
            _parse_added_rank(f, ev["add"], epoch, types, corunner, roster)
        else:
            _parse_rank_event(f, ev, actions[0], epoch, corunner, roster)
    roster.events.sort(key=lambda ev: ev["epoch"])  # stable: same-epoch events keep the file's order
    return events


def _parse_added_rank(f: str, a: Any, epoch: int, types: _DeviceTypes, corunner: _CorunnerCheck,
                      roster: _Roster) -> None:
    """An ``{"epoch": e, "add": {...}}`` event: a rank joins."""
    if not isinstance(a, dict) or "device" not in a or set(a) - {"device", "corunner", "data"}:
        raise _err(f"{f}.add", a, 'use {"device": <a name from devices>, "corunner": null or a name}.')
    _check_device(f"{f}.add.device", a["device"], types)
    c = corunner(f"{f}.add.corunner", a.get("corunner"))
    roster.add(epoch, a["device"], c, float(_num(f"{f}.add.data", a.get("data", 0.0))))


def _parse_rank_event(f: str, ev: dict[str, Any], act: str, epoch: int, corunner: _CorunnerCheck,
                      roster: _Roster) -> None:
    """A ``corunner`` / ``speed`` / ``ramp`` / ``lost`` event on existing ranks."""
    n = len(roster.device)
    rs = ev["ranks"] if "ranks" in ev else [ev.get("rank")]
    field = f"{f}.ranks" if "ranks" in ev else f"{f}.rank"
    if not isinstance(rs, list) or not rs or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n for r in rs):
        raise _err(field, ev.get("ranks", ev.get("rank")), f"use a rank index in [0, {n - 1}] (ranks added by earlier "
                   "events count after the listed ones).")
    rs = list(rs)
    if act == "corunner":
        roster.events.append({"epoch": epoch, "kind": "corunner", "ranks": rs,
                              "corunner": corunner(f"{f}.corunner", ev["corunner"])})
    elif act == "speed":
        roster.events.append({"epoch": epoch, "kind": "speed", "ranks": rs,
                              "factor": float(_num(f"{f}.speed", ev["speed"], strict=True))})
    elif act == "ramp":
        roster.events.append({"epoch": epoch, "kind": "ramp", "ranks": rs,
                              "factor": float(_num(f"{f}.ramp", ev["ramp"], strict=True)),
                              "epochs": _num(f"{f}.over", ev.get("over", 1), minimum=1, integer=True)})
    else:
        if ev["lost"] is not True:
            raise _err(f"{f}.lost", ev["lost"], "use true (the rank is lost from this epoch on).")
        early = [r for r in rs if roster.join[r] > epoch]
        if early:  # it would never join
            raise _err(field, ev.get("ranks", ev.get("rank")), f"rank {early[0]} joins at epoch "
                       f"{roster.join[early[0]]}; lose it at that epoch or later.")
        for r in rs:
            roster.leave[r] = epoch if roster.leave[r] is None else min(roster.leave[r], epoch)  # type: ignore[type-var]
        roster.events.append({"epoch": epoch, "kind": "lost", "ranks": rs})


def _check_membership(roster: _Roster, caps: list[int | None], epochs: int, gb: int, events: Any) -> None:
    """At every epoch where ranks join or leave: some rank is left, and the global batch fits the ranks."""
    join, leave = roster.join, roster.leave
    for e in sorted({0, *join, *(x for x in leave if x is not None)}):
        if e >= epochs:
            continue
        act_r = [r for r in range(len(roster.device)) if join[r] <= e and (leave[r] is None or e < leave[r])]
        if not act_r:
            raise _err("events", events, f"every rank is lost by epoch {e}; keep at least one rank.")
        if len(act_r) > gb:
            raise _err("global_batch", gb, f"{len(act_r)} ranks are active in epoch {e}; use a global_batch >= {len(act_r)}.")
        act_caps = [caps[r] for r in act_r]
        if all(c is not None for c in act_caps) and sum(act_caps) < gb:  # type: ignore[arg-type]
            raise _err("global_batch", gb, f"the memory_samples of the ranks active in epoch {e} sum to "
                       f"{sum(act_caps)}; lower global_batch or raise memory_samples.")  # type: ignore[arg-type]


def _parse_allreduce(spec: dict[str, Any]) -> tuple[float, float, float]:
    """``allreduce``: ``(latency, bytes, bandwidth)`` of the ring all-reduce (zeros when absent)."""
    allreduce = spec.get("allreduce")
    if allreduce is None:
        return (0.0, 0.0, 0.0)
    if not isinstance(allreduce, dict) or set(allreduce) - {"latency", "bytes", "bandwidth"}:
        raise _err("allreduce", allreduce, 'use {"latency": seconds, "bytes": gradient bytes, "bandwidth": bytes per second}.')
    return (float(_num("allreduce.latency", allreduce.get("latency", 0.0))),
            float(_num("allreduce.bytes", allreduce.get("bytes", 0.0))),
            float(_num("allreduce.bandwidth", allreduce.get("bandwidth", 1e10), strict=True)))


def _parse_slots(spec: dict[str, Any], types: _DeviceTypes, corunner: _CorunnerCheck) -> list[dict[str, Any]]:
    """``free_slots``: idle places, each ``{"device", "corunner", "data"}``."""
    slots = spec.get("free_slots", [])
    if not isinstance(slots, list):
        raise _err("free_slots", slots, 'use a list of {"device": <a name from devices>, "corunner": null or a name}.')
    parsed = []
    for k, slot in enumerate(slots):
        f = f"free_slots[{k}]"
        if not isinstance(slot, dict) or "device" not in slot or set(slot) - {"device", "corunner", "data"}:
            raise _err(f, slot, 'use {"device": <a name from devices>, "corunner": null or a name, "data": seconds (optional)}.')
        _check_device(f"{f}.device", slot["device"], types)
        parsed.append({"device": slot["device"], "corunner": corunner(f"{f}.corunner", slot.get("corunner")),
                       "data": float(_num(f"{f}.data", slot.get("data", 0.0)))})
    return parsed


def _parse_slot_events(spec: dict[str, Any], slots: list[dict[str, Any]], corunner: _CorunnerCheck
                       ) -> list[dict[str, Any]]:
    """The ``events`` on free slots: ``{"epoch", "slot": k, "taken": bool}`` or ``{"epoch", "slot": k, "corunner"}``."""
    out = []
    for k, ev in enumerate(spec.get("events", [])):
        if "slot" not in ev:
            continue
        f = f"events[{k}]"
        extra = set(ev) - {"epoch", "slot", "taken", "corunner"}
        if extra or ("taken" in ev) == ("corunner" in ev):
            raise _err(f, ev, 'a free-slot event is {"epoch": e, "slot": k, "taken": true|false} or '
                       '{"epoch": e, "slot": k, "corunner": name or null}.')
        s = ev["slot"]
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < len(slots):
            raise _err(f"{f}.slot", s, f"use the index of a free slot in [0, {len(slots) - 1}]." if slots
                       else "add free_slots first; this scenario has none.")
        if "taken" in ev:
            if not isinstance(ev["taken"], bool):
                raise _err(f"{f}.taken", ev["taken"], "use true (another job takes the slot) or false (it is freed).")
            out.append({"epoch": ev["epoch"], "slot": s, "taken": ev["taken"]})
        else:
            out.append({"epoch": ev["epoch"], "slot": s, "corunner": corunner(f"{f}.corunner", ev["corunner"])})
    out.sort(key=lambda ev: ev["epoch"])  # stable
    return out


def _parse(spec: dict[str, Any], default_name: str) -> Scenario:
    """Validate a scenario in the scenario schema (see :func:`load_scenario`) and build the :class:`Scenario`.

    Sections are checked in a fixed order (fields, devices, interference, ranks, events, job, allreduce,
    free slots), so the first error reported is always the same.
    """
    name = _check_fields(spec, default_name)
    types = _parse_devices(spec)
    interference = _parse_interference(spec, types)
    corunner = _corunner_check(interference)
    roster = _parse_ranks(spec, types, corunner)
    events = _parse_events(spec, types, corunner, roster)
    epochs = _num("epochs", spec.get("epochs", 10), minimum=1, integer=True)
    gb = _num("global_batch", spec["global_batch"], minimum=1, integer=True)
    caps = [types[d].memory_samples for d in roster.device]
    _check_membership(roster, caps, epochs, gb, events)
    workload = spec.get("workload", "training")
    if not isinstance(workload, str) or not workload:
        raise _err("workload", workload, "use a string such as 'resnet' or 'training'.")
    allreduce = _parse_allreduce(spec)
    free_slots = _parse_slots(spec, types, corunner)
    slot_events = _parse_slot_events(spec, free_slots, corunner)
    return Scenario(
        name=name,
        global_batch=gb,
        device=tuple(roster.device),
        intercept=tuple(types[d].overhead for d in roster.device),
        slope=tuple(types[d].cost_per_sample for d in roster.device),
        max_batch=tuple(caps),
        data=tuple(roster.data),
        events=tuple(roster.events),
        interference=interference,
        workload=workload,
        epochs=epochs,
        steps_per_epoch=_num("steps_per_epoch", spec.get("steps_per_epoch", 20), minimum=1, integer=True),
        noise=float(_noise(spec.get("noise", 0.02))),
        seed=_num("seed", spec.get("seed", 0), minimum=0, integer=True),
        join=tuple(roster.join),
        leave=tuple(roster.leave),
        allreduce=allreduce,
        free_slots=tuple(free_slots),
        restart_cost=float(_num("restart_cost", spec.get("restart_cost", 0.2))),
        device_types=types,
        slot_events=tuple(slot_events),
    )


def load_scenario(source: Scenario | str | Path | Mapping[str, Any]) -> Scenario:
    """Validate a scenario given as a built-in name, a JSON file path or a dict (a :class:`Scenario` passes through).

    The schema (documented in docs/scheduler.md): ``ranks`` (``device``, ``corunner``, ``data``,
    ``count``), ``devices`` (``cost_per_sample``, ``overhead``, ``memory_samples``, ``saturation``, ``cliff``:
    see :class:`DeviceType`), ``global_batch`` and the
    optional ``free_slots``, ``epochs``, ``steps_per_epoch``, ``noise``, ``seed``, ``allreduce``,
    ``interference``, ``events`` (on ranks, or on free slots: ``{"epoch", "slot", "taken"}`` and
    ``{"epoch", "slot", "corunner"}``), ``name``, ``workload``, ``description``.

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
