"""The candidate moves a relocator scores at an epoch boundary, and the decision that applies one.

:func:`candidate_actions` lists the placements worth comparing (the greedy best placement, single moves of the
slowest ranks to the best free slots, relocated ranks back home), each priced by the exact continuous
equal-finish time of its lines; :func:`candidate_decision` turns one into a
:class:`~hetero_plugins.scheduler.relocation.Relocation`. Shared by the learned relocator
(:mod:`~hetero_plugins.scheduler.placement_policy`) and the model-based one
(:mod:`~hetero_plugins.scheduler.planning`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetero_plugins.balancing.allocators import equal_finish_time
from hetero_plugins.scheduler.placement import best_placement
from hetero_plugins.scheduler.relocation import Relocation

__all__ = ["candidate_actions", "candidate_decision", "free_homes", "move_record", "placement_step_time",
           "places_after", "realised_gain", "slot_places", "smoothed_shortfall"]


def placement_step_time(lines: Sequence[Mapping[str, float]], global_batch: int) -> float:
    """The exact continuous equal-finish step time of places ``{"intercept", "slope", "data"}`` (seconds)."""
    fixed = np.array([x["intercept"] + x["data"] for x in lines])
    slope = np.maximum(np.array([x["slope"] for x in lines]), 1e-12)
    return float(equal_finish_time(fixed, slope, global_batch))


def candidate_actions(own: list[dict[str, Any]], incoming: list[dict[str, Any]], global_batch: int,
                      homes_free: Mapping[int, int] | None = None, slowest: int = 3, best_slots: int = 3,
                      penalty: float = 0.01) -> list[dict[str, Any]]:
    """The moves worth scoring: each ``{"moves": {rank: incoming index}, "kind", "t_new"}`` with a positive
    predicted gain on the given lines (stay is implicit and not listed).

    Args:
        own: each rank's predicted line at its own place next epoch ``{"intercept", "slope", "data"}``.
        incoming: the priced free slots (same keys).
        global_batch: samples per step.
        homes_free: relocated rank -> the incoming index of its free home place.
        slowest, best_slots: single moves are tried from the ``slowest`` ranks to the ``best_slots`` free slots.
        penalty: a free slot must beat a rank's own place by this fraction in the greedy placement.
    """
    n = len(own)
    t_cur = placement_step_time(own, global_batch)
    out: list[dict[str, Any]] = []
    seen: set[tuple[tuple[int, int], ...]] = set()

    def add(moves: dict[int, int], kind: str) -> None:
        key = tuple(sorted(moves.items()))
        if not moves or key in seen or len(set(moves.values())) != len(moves):
            return
        seen.add(key)
        lines = [incoming[moves[i]] if i in moves else own[i] for i in range(n)]
        t_new = placement_step_time(lines, global_batch)
        if t_new < t_cur * (1 - 1e-9):  # safety: only placements the lines predict faster
            out.append({"moves": moves, "kind": kind, "t_new": t_new, "lines": lines})

    if incoming:
        cands = own + incoming
        penalised = [dict(c, intercept=c["intercept"] * (1 + penalty), slope=c["slope"] * (1 + penalty))
                     if k >= n else c for k, c in enumerate(cands)]
        chosen = best_placement(penalised, n, global_batch)
        taken = [k - n for k in chosen if k >= n]
        leaving = [i for i in range(n) if i not in chosen]
        add(dict(zip(leaving, taken)), "greedy")
        b = global_batch / max(n, 1)
        t_rank = np.array([x["intercept"] + x["data"] + x["slope"] * b for x in own])
        t_slot = np.array([x["intercept"] + x["data"] + x["slope"] * b for x in incoming])
        for i in np.argsort(-t_rank)[:slowest]:
            for k in np.argsort(t_slot)[:best_slots]:
                if t_slot[k] < t_rank[i]:
                    add({int(i): int(k)}, "single")
    for i, k in (homes_free or {}).items():
        add({int(i): int(k)}, "home")
    return out


def candidate_decision(cand: Mapping[str, Any], incoming: Sequence[Mapping[str, Any]],
                       lines: Sequence[tuple[float, float]], t_cur: float, saved: float = 0.0,
                       unknown: Sequence[int] = ()) -> Relocation:
    """The :class:`~hetero_plugins.scheduler.relocation.Relocation` that applies candidate ``cand`` (one of
    :func:`candidate_actions`): each mover goes to its priced free slot and takes that slot's line, the other
    ranks keep ``lines``."""
    targets: list[int | None] = [None] * len(lines)
    batches: list[int | None] = [None] * len(lines)
    new_lines = list(lines)
    for i, j in cand["moves"].items():
        targets[i] = incoming[j]["free_slot"]
        new_lines[i] = (incoming[j]["intercept"], incoming[j]["slope"])
        batches[i] = incoming[j].get("batch")
    return Relocation(targets, new_lines, t_cur, cand["t_new"], saved, len(incoming), list(unknown), batches)


def free_homes(places: Sequence[Any] | None, homes: Sequence[Any] | None, free_slots: Sequence[Mapping[str, Any]],
               incoming: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Each relocated rank (``places[i] != homes[i]``, place ids) whose home place is among the priced free
    slots ``incoming``: rank -> its index there (``{}`` without place ids). A free slot's place id is its
    ``"place"``, else ``("free", k)``."""
    if places is None or homes is None:
        return {}
    slot_ids = slot_places(free_slots)
    by_place = {slot_ids[x["free_slot"]]: j for j, x in enumerate(incoming)}
    return {i: by_place[h] for i, (p, h) in enumerate(zip(places, homes)) if p != h and h in by_place}


def slot_places(free_slots: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Each free slot's place id: its ``"place"``, else ``("free", k)``."""
    return [s.get("place", ("free", k)) for k, s in enumerate(free_slots)]


def places_after(cand: Mapping[str, Any], incoming: Sequence[Mapping[str, Any]], slot_ids: Sequence[Any],
                 places: Sequence[Any]) -> list[Any]:
    """Every rank's place id once the candidate ``cand`` is applied: each mover at its free slot's id
    (``slot_ids``: :func:`slot_places`), the others where they are (``places``)."""
    after = list(places)
    for i, j in cand["moves"].items():
        after[i] = slot_ids[incoming[j]["free_slot"]]
    return after


def move_record(cand: Mapping[str, Any], own: Sequence[Mapping[str, float]], t_cur: float,
                after: Sequence[Any] | None) -> dict[str, Any]:
    """What a relocator keeps of the candidate ``cand`` it applied, to learn from at the next boundary
    (:func:`realised_gain`): the movers, every rank's line before (``own``), the place ids after (``None``:
    unknown) and the gain the move was priced at, ``1 - t_new / t_cur``."""
    return {"moves": set(cand["moves"]), "stay": list(own), "after": None if after is None else list(after),
            "predicted": 1.0 - cand["t_new"] / t_cur}


def realised_gain(last: Mapping[str, Any], now: Sequence[Mapping[str, float]], global_batch: int,
                  places: Sequence[Any] | None = None) -> float | None:
    """The gain over staying that the lines ``now`` show for the move :func:`move_record` recorded: the movers'
    lines now against their lines before, the others' lines now on both sides. ``None`` when the two cannot be
    compared (another world size, or the ranks are not at the places the move left them)."""
    if len(now) != len(last["stay"]) or (places is not None and last["after"] is not None
                                         and list(places) != last["after"]):
        return None
    stay = [last["stay"][i] if i in last["moves"] else now[i] for i in range(len(now))]
    return 1.0 - placement_step_time(now, global_batch) / placement_step_time(stay, global_batch)


def smoothed_shortfall(shortfall: float, last: Mapping[str, Any], observed: float) -> float:
    """The relocators' online caution (``adapt``): the running shortfall ``shortfall`` updated with how much less
    the move :func:`move_record` recorded gained (``observed``, :func:`realised_gain`) than it was priced at,
    smoothed by halves and never below 0 (a move that beat its price earns no licence)."""
    return 0.5 * shortfall + 0.5 * max(last["predicted"] - observed, 0.0)
