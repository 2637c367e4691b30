"""The simulated cluster's truth: :class:`ClusterSim`, per-rank and per-place step times of a :class:`Scenario`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_int
from hetero_plugins.scheduler.sim.scenario import DeviceType, Scenario, load_scenario

__all__ = ["ClusterSim", "min_makespan_curves"]


class ClusterSim:
    """True per-rank step times of a :class:`Scenario`.

    Args:
        scenario: a :class:`Scenario`, a built-in name, a JSON path or a dict.
        seed: overrides the scenario's noise seed.
    """

    def __init__(self, scenario: Scenario | str | Path | Mapping[str, Any], seed: int | None = None) -> None:
        self.scenario = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        self.seed = self.scenario.seed if seed is None else check_int("seed", seed, minimum=0,
                                                                       hint="a noise seed, e.g. 0")
        sc = self.scenario
        self._a = np.asarray(sc.intercept, dtype=np.float64)
        self._beta = np.asarray(sc.slope, dtype=np.float64)
        self._data = np.asarray(sc.data, dtype=np.float64)
        types = sc.device_types or {d: DeviceType(i, b, m) for d, i, b, m in
                                    zip(sc.device, sc.intercept, sc.slope, sc.max_batch)}
        self._types = types
        self._linear = all(types[d].linear for d in self.place_devices())
        pd = self.place_devices()
        self._sat = np.array([float(types[d].saturation) for d in pd])
        self._cliff_at = np.array([np.inf if types[d].cliff_at is None else float(types[d].cliff_at) for d in pd])
        self._cliff_extra = np.array([types[d].cliff_factor - 1.0 for d in pd])

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

    def slot_corunners(self, epoch: int) -> list[str | None]:
        """Each free slot's co-runner in ``epoch`` (its own, then the slot events up to ``epoch``)."""
        out = [s["corunner"] for s in self.scenario.free_slots]
        for ev in self.scenario.slot_events:
            if ev["epoch"] <= epoch and "corunner" in ev:
                out[ev["slot"]] = ev["corunner"]
        return out

    def slot_taken(self, epoch: int) -> np.ndarray:
        """Whether each free slot is taken by another job in ``epoch`` (slot events ``taken``): a taken slot is
        offered to nobody, except that a slot one of the job's ranks occupies stays the job's."""
        out = np.zeros(len(self.scenario.free_slots), dtype=bool)
        for ev in self.scenario.slot_events:
            if ev["epoch"] <= epoch and "taken" in ev:
                out[ev["slot"]] = ev["taken"]
        return out

    def place_taken(self, epoch: int) -> np.ndarray:
        """Whether each place is taken by another job in ``epoch`` (ranks' own places never are)."""
        return np.concatenate([np.zeros(self.world_size, dtype=bool), self.slot_taken(epoch)])

    def work(self, plan: Sequence[int] | np.ndarray, places: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Effective samples of local batches ``plan`` on ``places`` (default: the ranks' own), so that a step
        takes ``(intercept + slope * work) * noise + data``
        (:class:`~hetero_plugins.scheduler.sim.scenario.DeviceType`)."""
        b = np.asarray(plan, dtype=np.float64)
        if self._linear:
            return b
        idx = np.arange(len(b)) if places is None else np.asarray(places, dtype=np.int64)
        w = np.maximum(b, self._sat[idx])
        extra = self._cliff_extra[idx]
        return w + extra * np.maximum(0.0, b - np.where(extra > 0, self._cliff_at[idx], 0.0))

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
        compute = (a + beta * self.work(plan, ranks)) * noise
        return compute, data

    def slots(self, epoch: int) -> list[dict[str, Any]]:
        """Every place a rank could run in ``epoch``: the active ranks' own (first) and the free slots, each
        ``{"device", "corunner", "data", "intercept", "slope", "max_batch", "rank"}`` with the *true* times."""
        sc = self.scenario
        a, beta, data = self.params(epoch)
        co = self.corunners(epoch)
        out = [{"device": sc.device[r], "corunner": co[r], "data": float(data[r]), "intercept": float(a[r]),
                "slope": float(beta[r]), "max_batch": sc.max_batch[r], "rank": int(r)} for r in self.active(epoch)]
        sco, taken = self.slot_corunners(epoch), self.slot_taken(epoch)
        for k, slot in enumerate(sc.free_slots):
            t = self._types[slot["device"]]
            c = sco[k]
            f = sc.interference[c].get(slot["device"], 1.0) if c else 1.0
            out.append({"device": slot["device"], "corunner": c, "data": slot["data"],
                        "intercept": t.overhead * f, "slope": t.cost_per_sample * f, "max_batch": t.memory_samples,
                        "rank": None, "free_slot": k, "taken": bool(taken[k])})
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
        return list(sc.max_batch) + [self._types[s["device"]].memory_samples for s in sc.free_slots]

    def place_corunners(self, epoch: int) -> list[str | None]:
        """The co-runner of every place in ``epoch`` (a free slot's own, changed by slot events)."""
        return self.corunners(epoch) + self.slot_corunners(epoch)

    def place_multipliers(self, epoch: int) -> np.ndarray:
        """The time multiplier of every place in ``epoch`` (events apply to the place a rank started on)."""
        sc = self.scenario
        free = [sc.interference[c].get(s["device"], 1.0) if c else 1.0
                for s, c in zip(sc.free_slots, self.slot_corunners(epoch))]
        return np.concatenate([self.multipliers(epoch), np.asarray(free, dtype=np.float64)])

    def place_params(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Noise-free ``(intercept, slope, data)`` of every place in ``epoch`` (the curve's line part; see
        :meth:`work`)."""
        sc = self.scenario
        types = self._types
        a0 = np.concatenate([self._a, [types[s["device"]].overhead for s in sc.free_slots]])
        b0 = np.concatenate([self._beta, [types[s["device"]].cost_per_sample for s in sc.free_slots]])
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
        return float(np.max(a + beta * self.work(plan) + data))


def min_makespan_curves(times: Callable[[np.ndarray], np.ndarray], global_batch: int,
                        min_batch: Sequence[int] | np.ndarray, max_batch: Sequence[int] | np.ndarray) -> np.ndarray:
    """Exact integer min-makespan split for per-rank nondecreasing step-time functions.

    ``times(b)`` maps an integer vector of local batches (one per rank) to the ranks' step times, each
    nondecreasing in its own batch (a saturation plateau, a memory cliff: any shape). The smallest makespan
    ``T*`` is one of the values ``t_i(b)``; bisection on ``T`` down to adjacent floats finds it exactly, with each
    rank's largest ``b`` in ``[min_batch, max_batch]`` such that ``t_i(b) <= T`` found by an integer bisection
    bracketed by the counts at the current ends. The surplus samples at ``T*`` leave the ranks that finish last
    (which keeps the makespan at ``T*``).

    Raises:
        ValueError: when ``max_batch`` sums to less than ``global_batch`` or ``min_batch`` to more.

    Example::

        >>> cliff = lambda b: np.array([0.001, 0.002]) * (b + [2, 0] * np.maximum(0, b - 200))  # rank 0: 3x beyond 200
        >>> min_makespan_curves(cliff, 400, [1, 1], [400, 400]).tolist()   # the linear split would be [267, 133]
        [240, 160]
    """
    lo = np.asarray(min_batch, dtype=np.int64)
    hi = np.asarray(max_batch, dtype=np.int64)
    if int(hi.sum()) < global_batch or int(lo.sum()) > global_batch or np.any(lo > hi):
        raise ValueError(f"min_makespan_curves: bounds min_batch={lo.tolist()} max_batch={hi.tolist()} cannot hold "
                         f"global_batch={global_batch}. HINT: use bounds with sum(min) <= global_batch <= sum(max).")

    def counts(t: float, c_lo: np.ndarray, c_hi: np.ndarray) -> np.ndarray:
        """Largest b in [c_lo, c_hi] with times(b) <= t per rank (c_lo is known to qualify or be lo - 1)."""
        left, right = c_lo.copy(), c_hi.copy()
        while np.any(left < right):
            mid = (left + right + 1) // 2
            ok = times(np.maximum(mid, lo)) <= t
            left = np.where(ok, mid, left)
            right = np.where(ok, right, mid - 1)
        return left

    t_lo = float(np.max(times(lo)))  # no makespan is below the slowest rank at its smallest batch
    c_top = hi.copy()
    c_bottom = counts(t_lo, lo - 1, hi)
    if int(c_bottom.sum()) >= global_batch:
        t_hi, c_hi = t_lo, c_bottom
    else:
        t_hi, c_hi = float(np.max(times(hi))), c_top
        c_lo = c_bottom
        while True:  # invariant: counts(t_lo) < global_batch <= counts(t_hi)
            mid = t_lo + 0.5 * (t_hi - t_lo)
            if not t_lo < mid < t_hi:
                break
            c = counts(mid, c_lo, c_hi)
            if int(c.sum()) >= global_batch:
                t_hi, c_hi = mid, c
            else:
                t_lo, c_lo = mid, c
    b = c_hi.copy()
    surplus = int(b.sum()) - int(global_batch)
    for _ in range(64):  # give back one sample at a time from the ranks that finish last
        if surplus <= 0:
            break
        t = times(b).astype(np.float64)
        t[b <= lo] = -np.inf
        k = min(surplus, int(np.isfinite(t).sum()))
        idx = np.argpartition(-t, k - 1)[:k]
        b[idx] -= 1
        surplus -= k
    if surplus > 0:  # long plateaus: the latest finishers give back all they can at once
        order = np.argsort(-times(b), kind="stable")
        room = (b - lo)[order]
        take = np.minimum(room, np.maximum(0, surplus - (np.cumsum(room) - room)))
        b[order] -= take
    return b
