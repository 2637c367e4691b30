"""The simulated cluster's truth: :class:`ClusterSim`, per-rank and per-place step times of a :class:`Scenario`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.scheduler.sim.scenario import Scenario, load_scenario

__all__ = ["ClusterSim"]


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
