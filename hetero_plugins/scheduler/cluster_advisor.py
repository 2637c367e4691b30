"""Rank 0's stage-2 work at an epoch boundary, shared by the Lightning and Horovod integrations.

:class:`ClusterAdvisor` reads the cluster description (:mod:`hetero_plugins.cluster`), hands an allocator with
``set_context`` the co-runner changes and data times before it decides, and asks a
:class:`~hetero_plugins.scheduler.relocation.Relocator` whether moving ranks to free slots pays. It holds no
collective: the integration runs it on rank 0 and broadcasts what it decides (one rank decides, all adopt).
It is where the description's names meet the learned models: a workload, device or co-runner name the
relocator's interference model does not know is announced once with a warning (:meth:`ClusterAdvisor.check_names`).

Example::

    >>> import numpy as np
    >>> adv = ClusterAdvisor(lambda e: {"ranks": [{"device": "v100"}, {"device": "t4", "corunner": "video" if e else None}]})
    >>> adv.start(0, 2)
    >>> upcoming = adv.before_decision(0, 2, allocator=None, data=[0.0, 0.0])
    >>> upcoming.corunners
    [None, 'video']
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from hetero_plugins.balancing.coordinator import data_times  # re-exported: it lives with the coordinator
from hetero_plugins.cluster import ClusterSource, ClusterView, HostsUnknown, read_cluster
from hetero_plugins.scheduler.relocation import Relocator

log = logging.getLogger(__name__)

__all__ = ["ClusterAdvisor", "data_times"]


class ClusterAdvisor:
    """Cluster context and relocation decisions for one training job (call on rank 0 only).

    Args:
        source: the cluster description: a JSON file path (re-read at every call) or a callable ``epoch -> dict``.
        relocation: ``True`` (the default: with an allocator that has ``guard``, such as ``"auto"``, the
            :class:`~hetero_plugins.scheduler.planning.PlanningRelocator` with the shipped critic under that
            allocator's guard, else a default :class:`~hetero_plugins.scheduler.relocation.Relocator`), ``False``
            (never relocate) or a ``Relocator``.

    Attributes:
        placement: the placement in force during the current epoch (``None`` before :meth:`start`).
    """

    def __init__(self, source: ClusterSource, relocation: bool | Any = True) -> None:
        self.source = source
        self.relocation = self.check_relocation(relocation)
        self.placement: ClusterView | None = None
        # A given relocator decides from the start; ``True`` builds the default at the first decision.
        self._relocator: Any = None if isinstance(self.relocation, bool) else self.relocation
        self._allocator: Any = None  # the allocator of the last decision (auto guards the relocator)
        self._names: Any = None  # a default Relocator, for its vocabulary only
        self._last_moves: list[tuple[int, int]] | None = None
        self._warned: set[str] = set()
        self._warned_names: set[tuple[str, str]] = set()

    @staticmethod
    def check_relocation(relocation: bool | Any) -> bool | Any:
        """``relocation`` if usable (``True``, ``False`` or a ``Relocator``), else a ``ValueError`` with the fix."""
        if not (isinstance(relocation, bool) or hasattr(relocation, "propose")):
            raise ValueError(f"`relocation`={relocation!r} is not usable. HINT: pass True (default Relocator), False, "
                             "or a hetero_plugins.scheduler.relocation.Relocator.")
        return relocation

    def start(self, epoch: int, world_size: int, hosts: Sequence[str] | None = None) -> None:
        """Read the placement of ``epoch`` (the first of this run); raises ``ValueError`` on a bad description.

        A ``slots`` description read before the ranks' hosts are known is checked at the first decision instead.
        """
        try:
            self.placement = read_cluster(self.source, epoch, world_size, hosts)
        except HostsUnknown:
            if hosts is not None:
                raise
        else:
            self.check_names(self.placement)

    def before_decision(self, epoch: int, world_size: int, allocator: Any, data: Sequence[float],
                        hosts: Sequence[str] | None = None) -> ClusterView | None:
        """At the end of ``epoch``: read the next epoch's placement and give ``allocator`` what changes.

        Returns the upcoming placement (``None`` if the description cannot be read now: a warning says why, and
        the decision goes ahead without context).
        """
        try:
            upcoming = read_cluster(self.source, epoch + 1, world_size, hosts)
        except ValueError as err:  # e.g. a manager caught mid-write
            key = str(err)
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(f"hetero_plugins: cluster description skipped this epoch: {err}", RuntimeWarning,
                              stacklevel=2)
            return None
        self._allocator = allocator
        self.check_names(upcoming)
        measured = self.placement or upcoming
        set_context = getattr(allocator, "set_context", None)
        if set_context is not None:
            set_context(data=list(data), devices=upcoming.devices, corunners=measured.corunners,
                        next_corunners=upcoming.corunners, workload=upcoming.workload)
        return upcoming

    def relocate(self, upcoming: ClusterView | None, planner: Any, steps_per_epoch: int, epochs_left: int,
                 data: Sequence[float]) -> tuple[Any, bool] | None:
        """After the decision: would moving ranks to the free slots pay? Adopts ``upcoming`` as the placement.

        Returns ``None`` when there is nothing to decide (no description, no free slot, relocation off, a rank
        without a time model), else ``(decision, new)``: the
        :class:`~hetero_plugins.scheduler.relocation.Relocation` and whether its moves differ from the last ones
        (so a spec is written and announced once per change).
        """
        measured, self.placement = self.placement, upcoming or self.placement
        if upcoming is None or not upcoming.free_slots or self.relocation is False:
            return None
        params = planner.model_params()
        if any(p is None for p in params):
            return None
        relocator = self._get_relocator()
        extra = {"planner": planner} if getattr(relocator, "observes_planner", False) else {}  # model-based: rolls it
        decision = relocator.propose(
            devices=upcoming.devices, corunners=(measured or upcoming).corunners, next_corunners=upcoming.corunners,
            lines=[(p.intercept, p.slope) for p in params], free_slots=upcoming.free_slots,
            global_batch=planner.global_batch, steps_per_epoch=int(steps_per_epoch), epochs_left=int(epochs_left),
            data=list(data), workload=upcoming.workload, **extra)
        new = bool(decision.moves) and decision.moves != self._last_moves
        self._last_moves = decision.moves
        return decision, new

    def _get_relocator(self) -> Any:
        """The relocator deciding the moves (``None`` with ``relocation=False``); with ``relocation=True``, built at
        the first decision: ``auto``'s guard around the critic-corrected planning relocator, or the greedy
        ``Relocator``."""
        if self._relocator is None and self.relocation is True:
            from hetero_plugins.scheduler.placement_policy import default_relocator

            self._relocator = default_relocator(self._allocator)
        return self._relocator

    def check_names(self, view: ClusterView) -> list[tuple[str, str]]:
        """Warn once per name in ``view`` that the relocator's interference model (NCF) does not know.

        The NCF knows a fixed vocabulary of workload, device and co-runner names (the ones it was trained on,
        :meth:`~hetero_plugins.scheduler.relocation.Relocator.known_names`). A name outside it is not an error:
        the description is re-read every epoch from a cluster manager that may bring a device type the model
        has never seen, and stage 2 has a safe fallback for it (documented in
        :class:`~hetero_plugins.scheduler.interference.InterferenceCorrection`): no slowdown is predicted
        where the name meets a co-runner, so such a rank's time line is left as measured and such a free slot
        is never chosen. But it must not pass silently (a typo would switch stage 2 off), so each unknown
        name is announced once with a ``RuntimeWarning`` naming the field, the value, the names the model
        knows and the fix. Names are checked against the relocator's model while relocation is on; with
        ``relocation=False`` against the model of the allocator's own correction (``auto``, ``dqn``: the
        ``interference`` they correct announced co-runner changes with), once an allocator has decided; not at
        all where neither model can tell its vocabulary (``equal_finish`` reads no names).

        Returns the ``(field, name)`` pairs not known (warned about now or before).
        """
        relocator = self._relocator
        if relocator is None and self.relocation is True:  # before the first decision: the default model's
            self._names = self._names or Relocator()  # vocabulary (the learned relocator's too)
            relocator = self._names
        model: Any = relocator
        whose, fix = "relocator", "relocation=Relocator(predictor=FILE)"
        if relocator is None:  # relocation off: the names reach the allocator's correction only
            model, whose = getattr(self._allocator, "correction", None), "allocator"
            fix = f"allocator={type(self._allocator).__name__}(interference=FILE)"
        known = getattr(model, "known_names", lambda: None)() if model is not None else None
        if known is None:
            return []
        unknown: list[tuple[str, str, str]] = []
        if view.workload not in known["workload"]:
            unknown.append(("workload", "workload", view.workload))
        for group, entries in (("ranks", view.places), ("free_slots", view.free_slots)):
            for i, place in enumerate(entries):
                if place["device"] not in known["device"]:
                    unknown.append((f"{group}[{i}].device", "device", place["device"]))
                if place["corunner"] is not None and place["corunner"] not in known["corunner"]:
                    unknown.append((f"{group}[{i}].corunner", "corunner", place["corunner"]))
        for where, kind, name in unknown:
            if (kind, name) in self._warned_names:
                continue
            self._warned_names.add((kind, name))
            warnings.warn(
                f"hetero_plugins: cluster description field `{where}` is {name!r}, a {kind} name the "
                f"{whose}'s interference model (NCF) does not know; "
                f"it knows {known[kind]}. Stage 2 falls back where the name meets a co-runner: no slowdown is "
                "predicted, so a rank's time line there is left as measured and a free slot there is never chosen. "
                "HINT: fix the name, or extend the model to it with "
                f"hetero_plugins.scheduler.transfer.transfer_ncf(samples, out=FILE) and pass {fix}.",
                RuntimeWarning, stacklevel=3)
        return [(where, name) for where, _, name in unknown]

    @staticmethod
    def info(epoch: int, decision: Any) -> dict[str, Any]:
        """The ``relocation`` record of a plan-history entry."""
        return {"epoch": epoch, "moves": [list(m) for m in decision.moves], "predicted_gain": decision.predicted_gain,
                "saved_seconds": decision.saved_seconds, "spec": None, "checkpoint": None}
