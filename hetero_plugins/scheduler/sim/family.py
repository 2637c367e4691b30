"""A generated family of simulated clusters with a fixed split by seed into training, validation and test.

Learned schedulers are pre-trained on the *train* seeds only, chosen on *val* and reported on *test*, the
protocol of learning-driven schedulers evaluated on unseen clusters (Zhang, Geng, Ma, "Learning-Driven
Interference-Aware Workload Parallelization for Streaming Applications in Heterogeneous Cluster", IEEE TPDS
2021, pre-train in simulation then run online). A scenario is drawn from its seed alone (deterministic) and
is an ordinary scenario dict (:func:`~hetero_plugins.scheduler.sim.load_scenario`). What varies:

- 4-256 ranks (any count with ``world=``), 2-6 device types whose costs per sample span about 10x, fixed
  costs per step, memory caps;
- step times that are not linear in the batch size: saturation below some samples, a memory cliff near
  capacity (device ``saturation`` and ``cliff``);
- co-runners arriving on ranks and leaving after heavy-tailed durations (many short, a few for the rest of
  the run), background load ramps, data-loading-bound ranks, 1-10% step noise;
- free slots that other jobs take and free, and co-runners on them; a restart cost for relocation;
- interference drawn from a measured table (``format`` 1: ``rows`` of ``workload``, ``corunner``,
  ``slowdown``): one workload of the table is the job, each device type gets a sensitivity ``s_d`` and the
  slowdown beside co-runner ``c`` is ``1 + s_d * (slowdown(workload, c) - 1)``.

Families: ``"default"`` and ``"shifted"`` (another device mix, with CPU-like devices, and another
interference draw: the table's other workloads and wider sensitivities), for transfer learning.

Example::

    >>> table = {"format": 1, "rows": [{"workload": "mlp", "corunner": "cpu_burn", "slowdown": 1.8},
    ...                                {"workload": "mlp", "corunner": "membw", "slowdown": 1.4}]}
    >>> split_of(7), split_of(18)
    ('val', 'test')
    >>> sc = load_scenario(generate_scenario(3, table=table, world=8))
    >>> sc.world_size
    8
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero_plugins.scheduler.sim.scenario import load_scenario  # noqa: F401  (the module docstring's example)

__all__ = ["FAMILIES", "SPLITS", "family_scenarios", "family_seeds", "generate_scenario", "has_churn_and_slots",
           "split_of", "table_pairs"]

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class _Profile:
    """How one family draws its clusters."""

    kinds: tuple[str, ...]         # device name prefixes ("cpu": CPU-like, big fixed cost, no saturation)
    base_cost: tuple[float, float]  # seconds per sample of the fastest type (log-uniform)
    span: tuple[float, float]      # cost ratio slowest / fastest
    p_saturation: float
    p_cliff: float
    cliff_factor: tuple[float, float]
    sensitivity: tuple[float, float]
    parity: int                    # which of the table's workloads (sorted, every other one) the job is drawn from
    churn: float                   # co-runner arrivals per rank per epoch
    p_data_bound: tuple[float, float]


_PROFILES: dict[str, _Profile] = {
    "default": _Profile(kinds=("gpu",), base_cost=(1e-4, 5e-4), span=(6.0, 12.0), p_saturation=0.5, p_cliff=0.5,
                        cliff_factor=(1.5, 4.0), sensitivity=(0.6, 1.4), parity=0, churn=0.06,
                        p_data_bound=(0.0, 0.15)),
    "shifted": _Profile(kinds=("gpu", "cpu"), base_cost=(2e-4, 1e-3), span=(4.0, 14.0), p_saturation=0.3,
                        p_cliff=0.6, cliff_factor=(2.0, 6.0), sensitivity=(0.3, 2.0), parity=1, churn=0.10,
                        p_data_bound=(0.05, 0.25)),
}
FAMILIES = tuple(_PROFILES)


def split_of(seed: int) -> str:
    """The split of a seed: ``seed % 10`` in 0-6 is ``"train"``, 7 ``"val"``, 8-9 ``"test"``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"split_of: `seed` must be an integer >= 0, got {seed!r}. HINT: use 0, 1, 2, ...")
    r = int(seed) % 10
    return "train" if r <= 6 else "val" if r == 7 else "test"


def family_seeds(split: str, count: int) -> list[int]:
    """The first ``count`` seeds of ``split`` (in increasing order)."""
    if split not in SPLITS:
        raise ValueError(f"family_seeds: `split` must be one of {SPLITS}, got {split!r}. HINT: train on 'train', "
                         "choose on 'val', report on 'test'.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"family_seeds: `count` must be an integer >= 0, got {count!r}. HINT: e.g. count=30.")
    return list(itertools.islice((s for s in itertools.count() if split_of(s) == split), count))


def family_scenarios(split: str, count: int, family: str = "default", **kw: Any) -> list[dict[str, Any]]:
    """The scenarios of the first ``count`` seeds of ``split`` (keywords go to :func:`generate_scenario`)."""
    return [generate_scenario(s, family, **kw) for s in family_seeds(split, count)]


def has_churn_and_slots(spec: Mapping[str, Any]) -> bool:
    """Whether a scenario has co-runners that arrive or leave (on ranks or slots) and at least one free slot: the
    clusters where relocation can act, over which the benchmarks average the placement targets."""
    return bool(spec.get("free_slots")) and any("corunner" in ev for ev in spec.get("events", []))


def table_pairs(table: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """``{(workload, corunner): slowdown}`` of a measured table (``format`` 1; the mean over devices and repeats)."""
    rows = table.get("rows") if isinstance(table, Mapping) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"interference table: `rows` must be a non-empty list, got {rows!r}. HINT: pass a measured "
                         'table {"format": 1, "rows": [{"workload", "corunner", "slowdown", ...}]} '
                         "(hetero-plugins profile-interference writes one).")
    acc: dict[tuple[str, str], list[float]] = {}
    for k, row in enumerate(rows):
        try:
            key, s = (str(row["workload"]), str(row["corunner"])), float(row["slowdown"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"interference table: `rows[{k}]` is invalid: got {row!r}. HINT: each row needs "
                             '"workload", "corunner" and a numeric "slowdown".') from None
        if not np.isfinite(s) or s <= 0:
            raise ValueError(f"interference table: `rows[{k}].slowdown` is invalid: got {s!r}. HINT: use a "
                             "positive finite slowdown (shared time over solo time).")
        acc.setdefault(key, []).append(s)
    return {k: float(np.mean(v)) for k, v in acc.items()}


@functools.lru_cache(maxsize=1)
def _shipped_pairs() -> tuple[tuple[tuple[str, str], float], ...]:
    try:
        from hetero_plugins.scheduler.measured import load_table

        table = load_table()
    except (ImportError, OSError) as err:
        raise ValueError(f"generate_scenario: `table` is None and no measured interference table is shipped ({err}). "
                         "HINT: pass table= a measured table dict (format 1).") from None
    return tuple(sorted(table_pairs(table).items()))


def _g(x: float) -> float:
    return float(f"{x:.6g}")


def _duration(rng: np.random.Generator) -> int:
    """A heavy-tailed duration in epochs (Pareto, shape 1.1): mostly 1-3 epochs, now and then the whole run."""
    return int(np.ceil(1.0 + rng.pareto(1.1)))


def generate_scenario(seed: int, family: str = "default", *, world: int | None = None,
                      table: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One scenario of the family, drawn from ``seed`` alone (see the module docstring for what varies).

    Args:
        seed: the scenario's seed (its split is :func:`split_of`); also the scenario's noise seed.
        family: one of :data:`FAMILIES`.
        world: number of ranks (default: drawn log-uniformly in 4-256).
        table: a measured interference table (``format`` 1); ``None``: the shipped one.

    Returns:
        a scenario dict accepted by :func:`~hetero_plugins.scheduler.sim.load_scenario`.
    """
    split = split_of(seed)
    if family not in _PROFILES:
        raise ValueError(f"generate_scenario: `family` must be one of {FAMILIES}, got {family!r}. HINT: use "
                         "'default' to pre-train and 'shifted' for transfer.")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 2):
        raise ValueError(f"generate_scenario: `world` must be an integer >= 2 or None, got {world!r}. HINT: e.g. "
                         "world=1024 for timing.")
    pairs = dict(_shipped_pairs()) if table is None else table_pairs(table)
    prof = _PROFILES[family]
    rng = np.random.default_rng([int(seed), zlib.crc32(family.encode()), 12])
    n = int(round(np.exp(rng.uniform(np.log(4), np.log(256))))) if world is None else world

    # Device types: costs spanning ~10x, fixed costs, memory caps, curves.
    nt = int(min(n, rng.integers(2, 7)))
    ratio = np.sort(np.exp(rng.uniform(0.0, np.log(prof.span[1]), nt)))
    ratio[0], ratio[-1] = 1.0, rng.uniform(*prof.span)
    ratio = np.sort(ratio)
    cost = np.exp(rng.uniform(*np.log(prof.base_cost))) * ratio
    kinds = [prof.kinds[int(rng.integers(len(prof.kinds)))] for _ in range(nt)]
    names = [f"{k}{i}" for i, k in enumerate(kinds)]
    counts = 1 + rng.multinomial(n - nt, rng.dirichlet(np.ones(nt)))
    gb = int(n * rng.choice([32, 64, 128, 256]))
    share = gb * (1.0 / cost) / float(np.sum(counts / cost))  # each type's proportional local batch
    devices: dict[str, dict[str, Any]] = {}
    step = []
    for i, d in enumerate(names):
        cap = max(8, int(np.ceil(share[i] * rng.uniform(1.3, 3.0))))
        cpu = kinds[i] == "cpu"
        spec: dict[str, Any] = {"cost_per_sample": _g(cost[i]),
                                "overhead": _g(cost[i] * share[i] * rng.uniform(*((0.3, 0.8) if cpu else (0.05, 0.4)))),
                                "memory_samples": cap}
        if not cpu and rng.random() < prof.p_saturation:
            spec["saturation"] = max(1, int(round(share[i] * rng.uniform(0.2, 0.9))))
        if rng.random() < prof.p_cliff:
            spec["cliff"] = {"at": max(1, int(round(cap * rng.uniform(0.55, 0.9)))),
                             "factor": _g(rng.uniform(*prof.cliff_factor))}
        devices[d] = spec
        step.append(spec["overhead"] + spec["cost_per_sample"] * share[i])
    t0 = float(np.mean(step))  # a typical step (seconds)
    device_of = [d for d, c in zip(names, counts) for _ in range(int(c))]
    rng.shuffle(device_of)

    # Interference from the measured table: the job is one of the table's workloads.
    workloads = sorted({w for w, _ in pairs})
    pool = workloads[prof.parity::2] or workloads
    workload = pool[int(rng.integers(len(pool)))]
    corunners = sorted(c for w, c in pairs if w == workload)
    sens = {d: rng.uniform(*prof.sensitivity) for d in names}
    interference = {c: {d: _g(max(1.0, 1.0 + sens[d] * (pairs[(workload, c)] - 1.0))) for d in names}
                    for c in corunners}

    epochs = int(rng.integers(8, 17))  # short runs keep a sweep over many scenarios, policies and seeds fast
    steps = int(rng.integers(6, 13))
    p_data = rng.uniform(*prof.p_data_bound)
    ranks = []
    for d in device_of:
        u = rng.random()
        data = t0 * rng.uniform(0.6, 1.5) if u < p_data else t0 * rng.uniform(0.0, 0.05) if u < 0.5 else 0.0
        ranks.append({"device": d, "corunner": None, "data": _g(data)})

    events: list[dict[str, Any]] = []
    busy_until = np.zeros(n, dtype=np.int64)  # a rank's co-runner interval ends here (no overlaps on one rank)

    def corunner_on(r: int, start: int) -> None:
        end = start + _duration(rng)
        c = corunners[int(rng.integers(len(corunners)))]
        if start == 0:
            ranks[r]["corunner"] = c
        else:
            events.append({"epoch": start, "rank": r, "corunner": c})
        if end < epochs:
            events.append({"epoch": end, "rank": r, "corunner": None})
        busy_until[r] = end

    for r in range(n):
        if rng.random() < 0.1:
            corunner_on(r, 0)
    arrivals = int(min(rng.poisson(prof.churn * n * epochs), 4 * n))
    for t, r in sorted(zip(rng.integers(1, epochs, arrivals).tolist(), rng.integers(0, n, arrivals).tolist())):
        if busy_until[r] <= t:
            corunner_on(r, t)
    if rng.random() < 0.6:  # background load ramps up on some ranks (a non-dedicated node), and may go away
        for _ in range(int(rng.integers(1, 4))):
            rs = sorted(set(rng.integers(0, n, int(rng.integers(1, max(2, n // 8) + 1))).tolist()))
            start = int(rng.integers(0, epochs - 1))
            events.append({"epoch": start, "ranks": rs, "ramp": _g(rng.uniform(1.3, 2.5)),
                           "over": int(rng.integers(2, 9))})
            if rng.random() < 0.5:
                events.append({"epoch": int(rng.integers(start + 1, epochs)), "ranks": rs, "speed": 1.0})

    # Free slots: mostly of fast types; other jobs take and free them, co-runners come and go on them.
    slots = []
    if rng.random() < 0.8:
        speed = 1.0 / cost
        for k in range(int(rng.integers(1, max(2, n // 8) + 1))):
            d = names[int(rng.choice(nt, p=speed / speed.sum()))]
            c = corunners[int(rng.integers(len(corunners)))] if rng.random() < 0.2 else None
            slots.append({"device": d, "corunner": c, "data": _g(t0 * rng.uniform(0.0, 0.05))})
            if rng.random() < 0.3:  # taken at the start, freed later
                events.append({"epoch": 0, "slot": k, "taken": True})
                events.append({"epoch": int(rng.integers(1, epochs)), "slot": k, "taken": False})
            elif rng.random() < 0.5:  # free at the start, taken for a while
                start = int(rng.integers(1, epochs))
                events.append({"epoch": start, "slot": k, "taken": True})
                end = start + _duration(rng)
                if end < epochs:
                    events.append({"epoch": end, "slot": k, "taken": False})
            if rng.random() < 0.3:  # a co-runner arrives on the slot
                start = int(rng.integers(1, epochs))
                events.append({"epoch": start, "slot": k, "corunner": corunners[int(rng.integers(len(corunners)))]})
                end = start + _duration(rng)
                if end < epochs:
                    events.append({"epoch": end, "slot": k, "corunner": None})
    events.sort(key=lambda ev: ev["epoch"])

    bandwidth = float(np.exp(rng.uniform(np.log(5e9), np.log(2.5e10))))
    return {
        "name": f"{family}-{seed}",
        "description": f"Generated ({family} family, {split} split, seed {seed}): {n} ranks of {nt} device types.",
        "workload": workload,
        "devices": devices,
        "ranks": ranks,
        "free_slots": slots,
        "global_batch": gb,
        "epochs": epochs,
        "steps_per_epoch": steps,
        "noise": _g(rng.uniform(0.01, 0.10)),
        "seed": int(seed),
        "interference": interference,
        "allreduce": {"latency": 0.0005, "bytes": _g(t0 * bandwidth * rng.uniform(0.02, 0.2) / 2.0),
                      "bandwidth": _g(bandwidth)},
        "restart_cost": _g(t0 * steps * rng.uniform(0.1, 1.0)),
        "events": events,
    }
