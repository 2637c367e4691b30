"""Stage 2 feeding stage 1 and the relocator: fitted time lines scaled by the NCF's predicted co-runner slowdown.

Zhang, Geng, Ma (IEEE TPDS 2021), IAWP: interference between co-located jobs is predicted with neural
collaborative filtering (:class:`~hetero_plugins.scheduler.ncf.InterferencePredictor`). Both the learned
allocators (:mod:`~hetero_plugins.scheduler.policy`) and the
:class:`~hetero_plugins.scheduler.relocation.Relocator` read the predictions through
:class:`InterferenceCorrection`; :func:`interference_correction` turns their ``interference=`` /
``predictor=`` option into one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.scheduler.ncf import SOLO, InterferencePredictor

log = logging.getLogger(__name__)

__all__ = ["InterferenceCorrection", "interference_correction"]


class InterferenceCorrection:
    """Stage 2 feeding stage 1: scale fitted time lines by the NCF's predicted co-runner slowdown ratio.

    A rank's fitted line was measured beside its co-runner of the last epoch (``corunners``); when the
    context says another co-runner runs beside it in the next epoch (``next_corunners``: an arrival, a
    departure or a change), its intercept and slope are multiplied by
    ``NCF(workload, device, next) / NCF(workload, device, measured)``. Only co-runner *identities* are used,
    as a cluster manager knows them; the slowdown itself is the NCF's prediction (pre-trained on its own
    table, see :mod:`hetero_plugins.scheduler.pretrain`). Names the predictor does not know leave the line
    unchanged (logged once each).

    A device type the predictor was not trained on (a GPU beside a table measured on CPUs, say) gets the mean
    of the predictions for the same workload and co-runner over the device types it knows (``unseen_device=
    "mean"``, as :class:`~hetero_plugins.scheduler.policy.DQNAllocator` does): how much a co-runner slows a
    workload is mostly the pair's, and a device's own sensitivity scales it (the generated family draws it so).
    With ``"skip"`` every co-runner on such a device is unknown: the relocator then prices no slot with one
    and no announced arrival corrects a line.

    Args:
        predictor: an :class:`~hetero_plugins.scheduler.ncf.InterferencePredictor`, a model file, or
            ``None`` for the shipped default (loaded on first use).
        unseen_device: ``"mean"`` (default) or ``"skip"``, see above.
    """

    def __init__(self, predictor: Any = None, unseen_device: str = "mean") -> None:
        if unseen_device not in ("mean", "skip"):
            raise ValueError(f"`unseen_device`={unseen_device!r} is not an option. HINT: use 'mean' or 'skip'.")
        self.unseen_device = unseen_device
        self._source = predictor
        self._predictor: Any = None if predictor is None or isinstance(predictor, (str, Path)) else predictor
        self._cache: dict[tuple[str, str, str | None], float | None] = {}
        self.corrections = 0  #: ranks whose line was corrected so far

    @property
    def predictor(self) -> Any:
        """The predictor itself (a model file or the shipped model is read on first use)."""
        if self._predictor is None:
            self._predictor = InterferencePredictor.load(self._source)
        return self._predictor

    def known_names(self) -> dict[str, list[str]] | None:
        """The names the predictor knows, ``{"workload": [...], "device": [...], "corunner": [...]}`` (co-runners
        without ``"none"``, which stands for no co-runner); ``None`` for a predictor without a vocabulary."""
        names = [getattr(self.predictor, a, None) for a in ("workloads", "devices", "corunners")]
        if any(not isinstance(v, (list, tuple)) for v in names):
            return None
        return {"workload": list(names[0]), "device": list(names[1]),
                "corunner": [c for c in names[2] if c != SOLO]}

    def slowdown(self, workload: str, device: str, corunner: str | None) -> float | None:
        """The predicted slowdown of ``workload`` on ``device`` beside ``corunner`` (1 without one; ``None``
        when the predictor does not know a name)."""
        key = (workload, device, corunner)
        if key not in self._cache:
            if corunner is None:
                self._cache[key] = 1.0
            else:
                try:
                    self._cache[key] = float(self.predictor.predict(workload, device, corunner))
                except ValueError as err:
                    self._cache[key] = self._borrowed(workload, device, corunner)
                    if self._cache[key] is None:
                        log.info("interference correction skipped for %s: %s", key, err)
                    else:
                        log.info("interference for %s: the mean over the known devices (%s)", key, err)
        return self._cache[key]

    def _borrowed(self, workload: str, device: str, corunner: str) -> float | None:
        """The mean over the predictor's known device types, for a device type it does not know."""
        known = getattr(self._predictor, "devices", None)
        if self.unseen_device != "mean" or not isinstance(known, (list, tuple)) or not known or device in known:
            return None
        try:
            return float(np.mean([float(self._predictor.predict(workload, d, corunner)) for d in known]))
        except ValueError:
            return None

    def factors(self, workload: str, devices: Sequence[str], measured: Sequence[str | None],
                upcoming: Sequence[str | None]) -> np.ndarray:
        """Per-rank multipliers of the fitted lines (1 where nothing changes or a name is unknown)."""
        out = np.ones(len(devices))
        for i, (d, c0, c1) in enumerate(zip(devices, measured, upcoming)):
            if c0 == c1:
                continue
            s0, s1 = self.slowdown(workload, d, c0), self.slowdown(workload, d, c1)
            if s0 is not None and s1 is not None and s0 > 0:
                out[i] = s1 / s0
                self.corrections += 1
        return out


def interference_correction(value: Any, unseen_device: str = "mean") -> InterferenceCorrection | None:
    """The :class:`InterferenceCorrection` an ``interference=`` option asks for.

    ``True``: the shipped NCF; ``False`` / ``None``: no correction (``None`` returned); an
    ``InterferenceCorrection`` passes through (with its own ``unseen_device``); an ``InterferencePredictor``
    (anything with ``predict``) or the path of an NCF model file is wrapped. A correction built here gets
    ``unseen_device``.

    Example::

        >>> interference_correction(False) is None, type(interference_correction(True)).__name__
        (True, 'InterferenceCorrection')
    """
    if value is False or value is None:
        return None
    if value is True:
        return InterferenceCorrection(unseen_device=unseen_device)
    if isinstance(value, InterferenceCorrection):
        return value
    if isinstance(value, (str, Path)) or hasattr(value, "predict"):
        return InterferenceCorrection(value, unseen_device=unseen_device)
    raise ValueError(f"`interference`={value!r} is not usable. HINT: pass True (the shipped NCF), False (no "
                     "correction), an InterferencePredictor or the path of an NCF model file.")
