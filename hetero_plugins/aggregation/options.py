"""Gradient aggregation modes and their options: how the ranks' work of a step becomes one update.

Per-epoch (and mid-epoch) rebalancing fixes persistent heterogeneity; these modes cope with what it cannot:
a rank that stalls for a few steps because another job grabbed its GPU. Every mode keeps the epoch's
contract: each sample is processed exactly once per epoch, and every update is the sample-weighted mean
gradient of the samples it used.

=================  ==================================================================  =====================
mode               what a step does                                                    trade-off
=================  ==================================================================  =====================
``weighted``       every rank processes its planned share; gradients summed with        exact DDP maths; a
                   weights b_i / B (LBB, Yao et al. 2024; DBS, Ye et al. 2020).         stall stalls everyone
``deadline``       a rank works through its share in micro-batches until a deadline     bounded step time; a
                   derived from the time models; the gradient of what it finished is    late rank's samples
                   summed with the others, re-weighted by the samples actually          move to later steps
                   processed (the counts travel with the gradients); the rest is        (staleness of a few
                   carried into its next steps and re-routed by the planner (SA-ATP,    steps)
                   Li et al. 2024; fastest-k SGD with reduced load, seed 19).
``wbsp``           a rank that finishes its share keeps busy: it takes unclaimed        exact DDP maths, no
                   micro-batches of slower ranks' shares (claimed through a shared      idling; stolen
                   counter, loaded from the dataset) until the step's samples are       samples are loaded
                   all done (WBSP, Yang et al. 2024, translated to all-reduce, with     again by the thief
                   SA-ATP's "leading workers help the straggler").
``pseudo_sync``    the all-reduce of step k runs while step k+1 computes; step k+1      overlaps compute and
                   applies step k's reduced gradient, corrected by an adaptive          communication; one
                   exponential smoothing (Wen et al. 2023).                             step of staleness
``local_sgd``      H local optimizer steps between sample-weighted model averages       communication / H;
                   (Lin et al. 2018); each rank's batch keeps following its speed.      model drift between
                                                                                        averages
=================  ==================================================================  =====================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from hetero_plugins._validation import check_choice, check_float, check_int

__all__ = ["AGGREGATION_MODES", "AggregationOptions", "resolve_aggregation"]

#: The values ``aggregation=`` accepts.
AGGREGATION_MODES = ("weighted", "deadline", "wbsp", "pseudo_sync", "local_sgd")

#: Which options each mode reads; giving another one is an error.
_OPTIONS_OF = {
    "weighted": (),
    "deadline": ("micro_batches", "deadline_slack"),
    "wbsp": ("micro_batches", "claim_timeout"),
    "pseudo_sync": ("smoothing", "min_confidence"),
    "local_sgd": ("local_steps",),
}

_DEFAULTS: dict[str, Any] = {
    "micro_batches": 8,
    "deadline_slack": 0.5,
    "claim_timeout": 300.0,
    "smoothing": 0.9,
    "min_confidence": 0.5,
    "local_steps": 4,
}


@dataclass(frozen=True)
class AggregationOptions:
    """An aggregation mode and its options; options a mode does not read are refused.

    Args:
        mode: one of ``"weighted"`` (default), ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"``, ``"local_sgd"``
            (see the table in :mod:`hetero_plugins.aggregation`).
        micro_batches: ``deadline`` / ``wbsp``: units each rank's share is cut into (default 8): the grain of a
            deadline stop and of a steal. A rank runs one unit, then, when it is on time, the rest of its share
            as one piece, so a step costs two forward passes unless a rank is slow.
        deadline_slack: ``deadline``: a step's deadline is ``(1 + deadline_slack)`` times the predicted step
            time of the plan (default 0.5).
        claim_timeout: ``wbsp``: seconds a rank waits for the shared claim counters before giving up (default
            300).
        smoothing: ``pseudo_sync``: factor beta of the smoothed gradient history (default 0.9).
        min_confidence: ``pseudo_sync``: lower clip of the confidence in the delayed gradient (default 0.5;
            1.0 applies the plain one-step-delayed gradient).
        local_steps: ``local_sgd``: local steps H between model averages (default 4).

    Example::

        >>> AggregationOptions("deadline", deadline_slack=0.5).deadline_slack
        0.5
        >>> AggregationOptions("weighted", local_steps=8)
        Traceback (most recent call last):
        ...
        ValueError: `local_steps` does not apply to aggregation='weighted'; it is read by aggregation='local_sgd'. HINT: drop `local_steps` or choose aggregation='local_sgd'.
    """

    mode: str = "weighted"
    micro_batches: int | None = None
    deadline_slack: float | None = None
    claim_timeout: float | None = None
    smoothing: float | None = None
    min_confidence: float | None = None
    local_steps: int | None = None

    def __post_init__(self) -> None:
        check_choice("aggregation", self.mode, AGGREGATION_MODES)
        allowed = _OPTIONS_OF[self.mode]
        for f in fields(self):
            if f.name == "mode":
                continue
            value = getattr(self, f.name)
            if value is not None and f.name not in allowed:
                users = [m for m, opts in _OPTIONS_OF.items() if f.name in opts]
                readers = " or ".join(f"aggregation={m!r}" for m in users)
                raise ValueError(
                    f"`{f.name}` does not apply to aggregation={self.mode!r}; it is read by {readers}. "
                    f"HINT: drop `{f.name}` or choose {readers}."
                )
            if value is None and f.name in allowed:
                object.__setattr__(self, f.name, _DEFAULTS[f.name])
        if self.micro_batches is not None:
            check_int("micro_batches", self.micro_batches, minimum=1,
                      hint="the pieces a rank's batch is cut into, e.g. 4 (1: the whole batch at once)")
        if self.deadline_slack is not None:
            check_float("deadline_slack", self.deadline_slack, minimum=0.0, hint="0.2 waits 20% beyond the predicted step time")
        if self.claim_timeout is not None:
            check_float("claim_timeout", self.claim_timeout, minimum=0.0, strict_minimum=True,
                        hint="seconds a rank waits for a micro-batch claim to be answered, e.g. 30")
        if self.smoothing is not None:
            check_float("smoothing", self.smoothing, minimum=0.0, maximum=1.0, hint="e.g. 0.9 (below 1)")
            if self.smoothing >= 1.0:
                raise ValueError(f"`smoothing` must be < 1, got {self.smoothing}. HINT: e.g. 0.9 (1 would never update "
                                 "the correction).")
        if self.min_confidence is not None:
            check_float("min_confidence", self.min_confidence, minimum=0.0, maximum=1.0,
                        hint="a fraction in [0, 1], e.g. 0.3 (0: always correct)")
        if self.local_steps is not None:
            check_int("local_steps", self.local_steps, minimum=1, hint="1 averages after every step")

    @property
    def micro_batched(self) -> bool:
        """Whether a step runs as micro-batches (``deadline``, ``wbsp``)."""
        return self.mode in ("deadline", "wbsp")

    @property
    def explicit_sync(self) -> bool:
        """Whether gradients are exchanged by the mode rather than by the framework's per-step hook."""
        return self.mode != "weighted"

    def check_accumulation(self, argument: str, value: int) -> None:
        """Refuse gradient accumulation (``argument``: the framework's name for it) in the explicit modes,
        which exchange once per optimizer step.

        Example::

            >>> AggregationOptions("wbsp").check_accumulation("accumulate_grad_batches", 2)
            Traceback (most recent call last):
            ...
            ValueError: `accumulate_grad_batches`=2 does not combine with aggregation='wbsp' (the mode exchanges once per optimizer step). HINT: raise the per-rank batch size instead, or use aggregation='weighted'.
        """
        if self.explicit_sync and int(value) != 1:
            raise ValueError(
                f"`{argument}`={value} does not combine with aggregation={self.mode!r} (the mode exchanges once per "
                "optimizer step). HINT: raise the per-rank batch size instead, or use aggregation='weighted'."
            )

    def check_locality(self, locality: bool) -> None:
        """Refuse ``locality=True`` (each rank keeps its shard) in the modes that move samples between steps and
        ranks (``deadline``, ``wbsp``)."""
        if self.micro_batched and locality:
            raise ValueError(
                f"aggregation={self.mode!r} moves samples between steps and ranks, which `locality=True` forbids "
                "(each rank keeps its shard). HINT: use locality=False (the sampler's or the strategy's), or "
                "aggregation='weighted'."
            )

    def deadline(self, predicted_step_time: float) -> float:
        """Seconds a ``deadline`` step may run, from the plan's predicted step time (``inf`` when unknown)."""
        slack = self.deadline_slack
        if slack is None or not math.isfinite(predicted_step_time) or predicted_step_time <= 0:
            return math.inf  # slack is None in every mode but "deadline"
        return (1.0 + float(slack)) * predicted_step_time


def resolve_aggregation(aggregation: str | AggregationOptions | None) -> AggregationOptions:
    """``aggregation=`` as given to a strategy or optimizer: a mode name or an :class:`AggregationOptions`."""
    if aggregation is None:
        return AggregationOptions()
    if isinstance(aggregation, AggregationOptions):
        return aggregation
    if isinstance(aggregation, str) and aggregation in AGGREGATION_MODES:
        return AggregationOptions(aggregation)
    raise ValueError(
        f"`aggregation` must be one of {list(AGGREGATION_MODES)} or an AggregationOptions, got {aggregation!r}. "
        "HINT: e.g. aggregation='deadline' or aggregation=AggregationOptions('deadline', deadline_slack=0.3)."
    )
