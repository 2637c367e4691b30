"""``auto``'s guard around a relocator: moves are kept only when the allocator trusts its models.

:meth:`hetero_plugins.scheduler.policy.AutoAllocator.guard` builds a :class:`GuardedRelocator`. Stage 2 of
Zhang, Geng, Ma (IEEE TPDS 2021) moves work to other nodes on predicted interference; here a move goes ahead
only under the same checks as ``auto``'s NCF correction (its track record, the time models' residuals, the
ensemble's agreement), and a move the measurements show was mispriced is undone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float
from hetero_plugins.balancing.allocators import equal_finish_time
from hetero_plugins.scheduler.relocation import Relocation

log = logging.getLogger(__name__)

__all__ = ["GuardedRelocator"]


class GuardedRelocator:
    """A relocator whose moves an ``AutoAllocator`` must trust (``AutoAllocator.guard``).

    Moves are vetoed (the decision becomes "stay") when the allocator does not trust its models
    (``AutoAllocator.trusted``: the NCF's track record, the residual spread, or a disagreement at this
    boundary); with the allocator's ``measured_ratios``, when a slot a rank would move to has a measured slowdown
    in this run that disagrees with the NCF's; when the predicted saving over the next (at most three) epochs is below ``payback`` times the
    restart cost; when the predicted gain is below ``min_gain`` or within ``noise_margin`` residual spreads
    (``max_noise`` stands in for the spread before any residual is measured, at the first boundary); or when
    the lines predicted for the ranks it let move erred, one epoch after each move, by more than
    ``max_ncf_error`` (median over at least ``min_record`` moves; ``AutoAllocator.moved`` tells the allocator
    which ranks moved). Moves that only take ranks back to their own places (when the caller says where they
    are: ``homes`` and each free slot's ``place``, as the simulator passes to relocators that
    ``observes_places``) restore auto's no-relocation placement and are never vetoed; and with that place data
    the guard itself takes a rank it let move back home when its measured line there is slower than its home
    line (the line measured at home before the move, scaled by the NCF ratio of the home's co-runners then and
    next) by more than ``noise_margin`` residual spreads and the gain pays the restart cost over three epochs
    (``recovered``). ``kept`` and ``vetoed`` count decisions and ``last_reason`` says why.
    """

    def __init__(self, relocator: Any, allocator: Any, noise_margin: float = 0.0, min_gain: float = 0.0,
                 payback: float = 0.0) -> None:
        if not hasattr(relocator, "propose"):
            raise ValueError(f"`relocator`={relocator!r} has no propose(). HINT: pass a Relocator or LearnedRelocator.")
        self.noise_margin = check_float("noise_margin", noise_margin, minimum=0.0, hint="e.g. 0.0 or 2.0")
        self.min_gain = check_float("min_gain", min_gain, minimum=0.0, hint="e.g. 0.2")
        self.payback = check_float("payback", payback, minimum=0.0, hint="e.g. 2.0")
        self.inner = relocator
        self.allocator = allocator
        self.vetoed = 0  #: decisions turned into "stay"
        self.kept = 0  #: decisions with moves passed on (the relocator's or a return home)
        self.recovered = 0  #: returns home the guard decided itself
        self.last_reason = ""
        self._away: dict[int, dict[str, Any]] = {}  # home place -> the line measured there before the move

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _why_not_pays(self, decision: Any, kw: dict[str, Any]) -> str:
        """``""`` when the move's predicted saving over the next (at most three) epochs is at least ``payback``
        times the restart cost, else why not."""
        cost = kw.get("restart_cost", getattr(self.inner, "restart_cost", 0.0))
        epochs = min(int(kw.get("epochs_left", 1)), 3)
        per_step = float(decision.current_step_time) - float(decision.step_time)
        saved = per_step * int(kw.get("steps_per_epoch", 1)) * epochs
        if saved < self.payback * float(cost):
            return (f"predicted saving {saved:.2f} s over {epochs} epochs < payback {self.payback:g} x restart cost "
                    f"{float(cost):.2f} s")
        return ""

    def _why_not(self, decision: Any, free_slots: Any, workload: str) -> str:
        auto = self.allocator
        why = auto.trusted()
        if why:
            return why
        errs = auto.move_errors
        if len(errs) >= auto.min_record and math.expm1(float(np.median(np.abs(errs)))) > auto.max_ncf_error:
            return (f"the lines predicted for {len(errs)} moved ranks erred by "
                    f"{100 * math.expm1(float(np.median(np.abs(errs)))):.0f}% (median) > max_ncf_error")
        sigma = auto.noise()
        bound = auto.max_noise if sigma is None else sigma  # before any residual: the largest spread tolerated
        gain = float(decision.predicted_gain)
        if gain < self.min_gain:
            return f"predicted gain {100 * gain:.1f}% < min_gain {100 * self.min_gain:.0f}%"
        if gain <= self.noise_margin * bound:
            return (f"predicted gain {100 * gain:.1f}% within {self.noise_margin:g} residual spreads "
                    f"({100 * bound:.1f}%{', none measured yet: max_noise' if sigma is None else ''})")
        tol = math.log1p(auto.agreement)
        for _, k in decision.moves if auto.measured_ratios else ():
            slot = free_slots[k]
            d, c = slot.get("device"), slot.get("corunner")
            m = auto.measured_ratio(workload, d, None, c)
            s = auto.dqn.slowdown(workload, d, c)
            if m is not None and s is not None and abs(math.log(s / m)) > tol:
                return f"slot {k} ({d}, {c}): NCF slowdown {s:.2f} disagrees with the measured {m:.2f}"
        return ""

    #: Ask the simulator (and integrations that can) for each rank's place and home: moves home are never vetoed.
    observes_places = True
    _PLACE_KEYS = ("places", "homes", "epoch", "restart_cost")

    def _recover(self, kw: dict[str, Any]) -> Relocation | None:
        """Ranks this guard let move, now predicted faster back on their own (free) places: the decision that
        takes them home, when it pays over the relocator's horizon (``None`` otherwise or without place data).

        A rank's home line is its line measured there before the move, scaled by the NCF ratio between the
        co-runner it had then and the one there next epoch."""
        homes, places = kw.get("homes"), kw.get("places")
        if homes is None or places is None:
            return None
        for i, h in enumerate(homes):
            if places[i] == h:
                self._away.pop(int(h), None)
        slots = kw["free_slots"]
        home_slot = {s.get("place"): k for k, s in enumerate(slots)}
        n = len(homes)
        lines = [(float(a), float(b)) for a, b in kw["lines"]]
        data = [float(x) for x in (kw.get("data") or [0.0] * n)]
        workload = kw.get("workload") or getattr(self.inner, "workload", "training")
        new_lines, new_data, targets = list(lines), list(data), [None] * n
        for i, h in enumerate(homes):
            rec = self._away.get(int(h))
            if rec is None or places[i] == h or h not in home_slot:
                continue
            k = home_slot[h]
            d = slots[k].get("device")
            s0 = self.allocator.dqn.slowdown(workload, d, rec["corunner"])
            s1 = self.allocator.dqn.slowdown(workload, d, slots[k].get("corunner"))
            f = s1 / s0 if s0 is not None and s1 is not None and s0 > 0 else 1.0
            home = (rec["line"][0] * f, rec["line"][1] * f)
            if home[0] + home[1] * 64 < lines[i][0] + lines[i][1] * 64:  # faster at any common batch size
                new_lines[i], new_data[i], targets[i] = home, float(slots[k].get("data", 0.0) or 0.0), k
        if all(t is None for t in targets):
            return None
        gb = int(kw["global_batch"])
        t_cur = equal_finish_time([a + d for (a, _), d in zip(lines, data)], [max(b, 1e-12) for _, b in lines], gb)
        t_new = equal_finish_time([a + d for (a, _), d in zip(new_lines, new_data)],
                                  [max(b, 1e-12) for _, b in new_lines], gb)
        sigma = self.allocator.noise()
        bound = self.allocator.max_noise if sigma is None else sigma
        horizon = min(int(kw.get("epochs_left", 1)), 3) * int(kw.get("steps_per_epoch", 1))
        saved = (t_cur - t_new) * horizon - float(getattr(self.inner, "restart_cost", 0.0))
        if t_cur / t_new - 1.0 <= self.noise_margin * bound or saved <= 0:
            return None
        return Relocation(targets, new_lines, t_cur, t_new, float(saved), len(slots))

    def propose(self, **kw: Any) -> Any:
        inner_kw = kw if getattr(self.inner, "observes_places", False) else \
            {k: v for k, v in kw.items() if k not in self._PLACE_KEYS}
        decision = self.inner.propose(**inner_kw)
        homes, slots = kw.get("homes"), kw["free_slots"]
        back = self._recover(kw)
        if decision.moves and homes is not None and all(slots[k].get("place") == homes[i] for i, k in decision.moves):
            # Undoing relocations restores the no-relocation placement, auto's fallback: never vetoed.
            return self._keep(decision, kw, "ranks return to their own places")
        if back is not None:
            self.recovered += 1
            return self._keep(back, kw, "ranks the measurements show slower away from their own places go back")
        if not decision.moves:
            return decision
        workload = kw.get("workload") or getattr(self.inner, "workload", "training")
        why = self._why_not(decision, slots, workload) or self._why_not_pays(decision, kw)
        if not why:
            return self._keep(decision, kw, "models agree")
        self.last_reason = why
        self.vetoed += 1
        log.info("auto: relocation vetoed (%s)", why)
        n = len(kw["devices"])
        stay = {"targets": [None] * n, "lines": [tuple(x) for x in kw["lines"]],
                "step_time": decision.current_step_time, "saved_seconds": 0.0}
        if dataclasses.is_dataclass(decision):
            return dataclasses.replace(decision, **stay)
        return Relocation(current_step_time=decision.current_step_time, **stay)

    def _keep(self, decision: Any, kw: dict[str, Any], reason: str) -> Any:
        self.kept += 1
        self.last_reason = reason
        moved = [i for i, _ in decision.moves]
        homes, places = kw.get("homes"), kw.get("places")
        if homes is not None and places is not None:
            for i in moved:
                if places[i] == homes[i]:  # leaving home: remember the line measured there
                    self._away[int(homes[i])] = {"line": tuple(float(x) for x in kw["lines"][i]),
                                                 "corunner": kw["corunners"][i]}
        self.allocator.moved(moved)
        return decision
