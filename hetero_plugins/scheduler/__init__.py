"""The embedded two-stage learned scheduler, after Zhang, Geng, Ma, IEEE TPDS 2021.

- Stage 1 (LDWP): the batch split is exact (``min_makespan_split``) under any placement;
  :class:`DQNAllocator` (``allocator="dqn"``) splits on the fitted lines corrected by stage 2 for announced
  co-runners, and the placement Q-network (``placement_policy.LearnedRelocator``) decides relocations (or,
  model-based, ``planning.PlanningRelocator``, which rolls the balancing planner forward on its own model);
  :class:`AutoAllocator` (``allocator="auto"``, the default policy) makes the same split (a co-runner the NCF
  does not know is corrected by the ratio the run measured) and its ``guard`` keeps relocations only while the
  NCF's track record holds and the time models are not too noisy. Importing this
  package registers both (``import hetero_plugins`` does), so every ``allocator=`` option takes them by name.
- Stage 2 (IAWP): :class:`InterferencePredictor`, a NeuMF (He et al., WWW 2017) predicting co-runner
  slowdowns; :class:`Relocator` decides when moving ranks to free slots pays for a restart
  (:mod:`~hetero_plugins.scheduler.relocation`; :func:`plan_relocation` is its restart-cost-free form over one
  list of slots, kept for compatibility).
- :mod:`~hetero_plugins.scheduler.pretrain` and :mod:`~hetero_plugins.scheduler.transfer` build models on
  the simulator (:mod:`hetero_plugins.scheduler.sim`); shipped defaults live in ``models/`` and load by default.

Modules: ``policy`` (the two allocators), ``dqn`` and ``features`` (the former chunk-assignment network, kept for its
training commands), ``ncf`` (the
predictor), ``interference`` (its corrections of time lines), ``placement`` (best placement, equal-finish
split), ``problem`` (the decision record), ``relocation`` (the relocator), ``candidates`` (the moves relocators
score), ``planning`` (the model-based relocator), ``restart_spec`` (the restart spec
a relocation is written to and resumed from), ``cluster_advisor`` (cluster context for the integrations),
``pretrain`` / ``transfer`` / ``commands`` (training and the command line) and ``sim`` (the simulator).
"""

from hetero_plugins.scheduler.dqn import DQNTrainer, QNetwork
from hetero_plugins.scheduler.features import FEATURE_SCHEMA_VERSION, FEATURES
from hetero_plugins.scheduler.ncf import InterferencePredictor
from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator
from hetero_plugins.scheduler.relocation import (
    Relocation,
    RelocationPlan,
    Relocator,
    plan_relocation,
    write_restart_spec,
)
from hetero_plugins.scheduler.restart_spec import resume_checkpoint, write_relocation_spec

__all__ = [
    "FEATURES",
    "FEATURE_SCHEMA_VERSION",
    "AutoAllocator",
    "DQNAllocator",
    "DQNTrainer",
    "InterferencePredictor",
    "QNetwork",
    "Relocation",
    "RelocationPlan",
    "Relocator",
    "plan_relocation",
    "resume_checkpoint",
    "write_relocation_spec",
    "write_restart_spec",
]
