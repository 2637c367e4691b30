"""Make any machine behave like a heterogeneous cluster: per-rank speeds, speed changes, transient stalls.

The delay a rank adds to a step is ``overhead + cost_per_sample * local_batch / speed * stall_factor``.
Random stalls follow the DBS robustness harness (Ye et al. 2020): every epoch, each rank starts a slowdown
with a given probability, lasting a random number of steps.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetero_plugins._validation import check_float, check_int, check_positive_floats

__all__ = ["EmulationModel", "RandomStalls", "Stall"]


@dataclass(frozen=True)
class Stall:
    """Rank ``rank`` runs ``slowdown`` times slower for ``num_steps`` steps from ``start_step`` of ``epoch``."""

    rank: int
    epoch: int
    start_step: int = 0
    num_steps: int = 1
    slowdown: float = 4.0

    def __post_init__(self) -> None:
        check_int("Stall.rank", self.rank, minimum=0)
        check_int("Stall.epoch", self.epoch, minimum=0)
        check_int("Stall.start_step", self.start_step, minimum=0)
        check_int("Stall.num_steps", self.num_steps, minimum=1)
        check_float("Stall.slowdown", self.slowdown, minimum=1.0)

    def factor(self, rank: int, epoch: int, step: int) -> float:
        hit = rank == self.rank and epoch == self.epoch and self.start_step <= step < self.start_step + self.num_steps
        return self.slowdown if hit else 1.0


@dataclass(frozen=True)
class RandomStalls:
    """Each epoch each rank stalls with ``probability`` for ``min_steps``..``max_steps`` steps (seeded)."""

    probability: float = 0.1
    min_steps: int = 4
    max_steps: int = 20
    slowdown: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_float("RandomStalls.probability", self.probability, minimum=0.0, maximum=1.0)
        check_int("RandomStalls.min_steps", self.min_steps, minimum=1)
        check_int("RandomStalls.max_steps", self.max_steps, minimum=self.min_steps)
        check_float("RandomStalls.slowdown", self.slowdown, minimum=1.0)

    def factor(self, rank: int, epoch: int, step: int) -> float:
        rng = random.Random(f"{self.seed}-{rank}-{epoch}")
        if rng.random() >= self.probability:
            return 1.0
        length = rng.randint(self.min_steps, self.max_steps)
        start = rng.randint(0, self.max_steps)
        return self.slowdown if start <= step < start + length else 1.0


class EmulationModel:
    """Per-rank emulated compute delays.

    Args:
        speeds: relative speed of each rank (1.0 = reference; 0.25 = four times slower).
        cost_per_sample: seconds per sample at speed 1.
        schedule: speed changes, ``{epoch: speeds}`` with a full list of speeds or ``{rank: speed}``;
            each entry holds from that epoch on.
        stalls: transient slowdowns: :class:`Stall` entries and/or a :class:`RandomStalls`.
        overhead: fixed seconds added to every step of every rank.

    Example::

        >>> m = EmulationModel([1.0, 0.5], cost_per_sample=0.01, schedule={2: {0: 0.25}})
        >>> m.delay(rank=1, epoch=0, step=0, batch_size=10), m.delay(rank=0, epoch=3, step=0, batch_size=10)
        (0.2, 0.4)
    """

    def __init__(
        self,
        speeds: Sequence[float],
        cost_per_sample: float,
        schedule: Mapping[int, Sequence[float] | Mapping[int, float]] | None = None,
        stalls: Sequence[Stall | RandomStalls] | RandomStalls | None = None,
        overhead: float = 0.0,
    ) -> None:
        self.speeds = check_positive_floats("speeds", speeds, hint="e.g. speeds=[1, 1, 0.5, 0.25], one per rank")
        self.cost_per_sample = check_float("cost_per_sample", cost_per_sample, minimum=0.0)
        self.overhead = check_float("overhead", overhead, minimum=0.0)
        world = len(self.speeds)
        self.schedule: dict[int, dict[int, float]] = {}
        for epoch, change in sorted((schedule or {}).items()):
            check_int("schedule epoch", epoch, minimum=0)
            if isinstance(change, Mapping):
                items = dict(change)
                for r, s in items.items():
                    check_int(f"schedule[{epoch}] rank", r, minimum=0)
                    if r >= world:
                        raise ValueError(f"`schedule[{epoch}]` names rank {r}, but `speeds` has {world} ranks.")
                    check_positive_floats(f"schedule[{epoch}][{r}]", [s])
            else:
                items = dict(enumerate(check_positive_floats(f"schedule[{epoch}]", change, length=world)))
            self.schedule[epoch] = {int(r): float(s) for r, s in items.items()}
        if isinstance(stalls, RandomStalls):
            stalls = [stalls]
        self.stalls = list(stalls or [])
        for s in self.stalls:
            if not isinstance(s, (Stall, RandomStalls)):
                raise ValueError(f"`stalls` entries must be Stall or RandomStalls, got {s!r}.")
            if isinstance(s, Stall) and s.rank >= world:
                raise ValueError(f"`stalls` names rank {s.rank}, but `speeds` has {world} ranks.")

    @property
    def world_size(self) -> int:
        return len(self.speeds)

    def speed(self, rank: int, epoch: int) -> float:
        """Rank ``rank``'s speed during ``epoch`` (after scheduled changes, before stalls)."""
        s = self.speeds[rank]
        for e, change in self.schedule.items():
            if e <= epoch and rank in change:
                s = change[rank]
        return s

    def speeds_at(self, epoch: int) -> list[float]:
        return [self.speed(r, epoch) for r in range(self.world_size)]

    def stall_factor(self, rank: int, epoch: int, step: int) -> float:
        f = 1.0
        for s in self.stalls:
            f *= s.factor(rank, epoch, step)
        return f

    def delay(self, rank: int, epoch: int, step: int, batch_size: int) -> float:
        """Seconds rank ``rank`` should spend on a step of ``batch_size`` samples."""
        if rank >= self.world_size:
            raise ValueError(
                f"rank {rank} has no emulated speed: `speeds` has {self.world_size} entries. "
                "HINT: give one speed per rank."
            )
        work = self.cost_per_sample * batch_size / self.speed(rank, epoch)
        return self.overhead + work * self.stall_factor(rank, epoch, step)
