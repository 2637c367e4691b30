"""A cluster simulator for the balancing loop: per-rank true step times, events, and the planner in the loop.

The learned scheduler (:mod:`hetero_plugins.scheduler`) is pre-trained and benchmarked here, the way
the two-stage scheduler of Zhang, Geng, Ma ("Learning-Driven Interference-Aware Workload Parallelization for
Streaming Applications in Heterogeneous Cluster", IEEE TPDS 2021) is pre-trained before it runs online.

Model of one step on rank i, epoch e (all ranks wait at the gradient barrier for the slowest)::

    t_i(b) = (intercept_d + slope_d * b) * mult_i(e) * noise_i(e, step) + data_i

- ``intercept_d``/``slope_d`` belong to the rank's device type ``d`` (a CPU, an old or a new GPU...);
- ``mult_i(e)`` is the product of the events in force: ``speed`` (a step change of the time multiplier),
  ``ramp`` (a non-dedicated node's background load growing linearly over some epochs) and ``corunner``
  (a co-located job whose slowdown on this device type comes from the scenario's ``interference`` table);
- ``noise`` is multiplicative, seeded by (seed, epoch, step, rank) and independent of ``b``, so times are
  monotone in the batch size and a run is deterministic for a seed;
- ``data_i`` is a per-step cost outside the measured compute window (input pipeline, host copies): the
  planner's time models never see it, so analytic allocators cannot correct for it.

Scenarios are JSON-like dicts validated by :func:`load_scenario`; :data:`BUILTIN_SCENARIOS` holds
``paper_mix`` (a CPU-GPU mix in the spirit of the seed paper's cluster), ``interference`` (co-runners arrive
and leave), ``dynamic`` (non-dedicated nodes: ramps, a speed change and slow input pipelines) and ``large``
(1024 ranks).

Device types may also have step times that are not linear in the batch size (``saturation``: a smaller
batch than that takes no less time; ``cliff``: samples beyond a point near the memory capacity cost more), and
free slots have events of their own (another job takes / frees them, co-runners on them).

The modules: :mod:`~hetero_plugins.scheduler.sim.scenario` (the schema), :mod:`~hetero_plugins.scheduler.sim.builtin`
(the built-in scenarios), :mod:`~hetero_plugins.scheduler.sim.cluster` (the true times),
:mod:`~hetero_plugins.scheduler.sim.loop` (the planner in the loop, the oracle, decision problems),
:mod:`~hetero_plugins.scheduler.sim.family` (generated scenario families split into train / val / test) and
:mod:`~hetero_plugins.scheduler.sim.evaluate` (policies over many scenarios and seeds).

Example::

    >>> sc = load_scenario("paper_mix")
    >>> sim = ClusterSim(sc)
    >>> out = simulate(sc, "equal_finish", epochs=3)
    >>> out["epoch_times"][2] < out["epoch_times"][0]
    True
"""

from hetero_plugins.scheduler.placement import best_placement
from hetero_plugins.scheduler.problem import DecisionProblem
from hetero_plugins.scheduler.sim.builtin import BUILTIN_SCENARIOS
from hetero_plugins.scheduler.sim.cluster import ClusterSim, min_makespan_curves
from hetero_plugins.scheduler.sim.evaluate import best_analytic, evaluate
from hetero_plugins.scheduler.sim.family import FAMILIES, SPLITS, family_scenarios, generate_scenario, split_of
from hetero_plugins.scheduler.sim.loop import decision_problems, oracle, simulate
from hetero_plugins.scheduler.sim.scenario import DeviceType, Scenario, load_scenario
# Module-level names of the single-file simulator, still importable from here.
from hetero_plugins.scheduler.sim.scenario import DEFAULT_CORUNNERS, EVENT_KINDS, SCENARIO_FIELDS  # noqa: F401

__all__ = [
    "BUILTIN_SCENARIOS",
    "FAMILIES",
    "SPLITS",
    "ClusterSim",
    "DecisionProblem",
    "DeviceType",
    "Scenario",
    "best_analytic",
    "decision_problems",
    "best_placement",
    "evaluate",
    "family_scenarios",
    "generate_scenario",
    "load_scenario",
    "min_makespan_curves",
    "oracle",
    "simulate",
    "split_of",
]
