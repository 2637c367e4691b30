"""Options of the allocators that no longer exist, and why: passing one is refused with its reason rather than
with Python's bare unknown-keyword ``TypeError``."""

from __future__ import annotations

from typing import Any

__all__ = ["refuse_removed"]

#: Options of the chunk-assignment network that split batches before the split became exact.
_REMOVED = {
    "model": "the Q-network no longer splits batches (the split is exact); a placement network goes to the "
             "relocation (LearnedRelocator)",
    "chunks_per_rank": "there are no chunks: the split is exact (min_makespan_split)",
    "parallel": "there are no chunks: the split is exact (min_makespan_split)",
    "online": "the split is exact; online learning belongs to the placement network (LearnedRelocator)",
    "online_updates": "the split is exact; online learning belongs to the placement network (LearnedRelocator)",
    "online_lr": "the split is exact; online learning belongs to the placement network (LearnedRelocator)",
    "online_max_ranks": "the split is exact; online learning belongs to the placement network (LearnedRelocator)",
    "seed": "the split is exact and deterministic",
    "tolerance": "auto no longer compares a DQN plan with equal_finish; its gate is `agreement`",
    "score_data": "auto no longer compares a DQN plan with equal_finish",
}


def refuse_removed(cls: str, options: dict[str, Any]) -> None:
    """Refuse ``options``, the leftover keyword arguments of ``cls()``: a removed option with a ``ValueError`` that
    says why it went, anything else with the ``TypeError`` Python gives an unknown keyword argument."""
    for k, v in options.items():
        why = _REMOVED.get(k)
        if why is None:
            raise TypeError(f"{cls}() got an unexpected keyword argument {k!r}. HINT: see help({cls}) for its options.")
        raise ValueError(f"`{k}`={v!r} is no longer an option of {cls}: {why}. HINT: remove `{k}`.")
