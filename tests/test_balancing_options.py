"""``BalancingOptions`` (one options object for the four balancing classes) and ``PlanCoordinator`` (the epoch
boundary, one rank decides and all adopt) on a scripted single-process transport."""

from __future__ import annotations

import dataclasses
import doctest
import warnings

import numpy as np
import pytest
import torch

from hetero_plugins.balancing import coordinator as coordinator_module
from hetero_plugins.balancing import options as options_module
from hetero_plugins.balancing.coordinator import PlanCoordinator, data_times, gather_records, start_advisor
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.callbacks import BatchBalancer
from hetero_plugins.callbacks import batch_balancer as batch_balancer_module
from hetero_plugins.horovod import elastic as elastic_module
from hetero_plugins.strategies import HeteroDDPStrategy, HeteroHorovodStrategy


def test_doctests():
    for module in (options_module, coordinator_module, elastic_module, batch_balancer_module):
        assert doctest.testmod(module).failed == 0, module.__name__


# ---------------------------------------------------------------------------------------------- BalancingOptions
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_batch_size=0), "`min_batch_size` must be >= 1, got 0"),
        (dict(allocator="fast"), "`allocator` must be one of"),
        (dict(min_gain=-0.1), "`min_gain` must be >= 0.0"),
        (dict(max_batch_size=2, min_batch_size=4), "`max_batch_size` must be >= 4"),
        (dict(half_life=0), "`half_life` must be >= 0.5, got 0.0"),
        (dict(half_life=1e-10), "`half_life` must be >= 0.5"),  # at 1e-10 the time models turned NaN
        (dict(warmup_steps=-1), "`warmup_steps` must be >= 0"),
        (dict(cliff_epochs=-1), "`cliff_epochs` must be >= 0.*HINT: e.g. 4"),
        (dict(regime_reset="no"), "`regime_reset` must be True or False, got 'no'.*HINT"),
        (dict(replan_every=0), "`replan_every` must be >= 1, got 0.*HINT: use None"),
        (dict(memory_headroom=0.0), "`memory_headroom` must be > 0.0.*HINT"),
        (dict(memory_headroom=1.5), "`memory_headroom` must be <= 1.0.*HINT"),
        (dict(cluster=3), "`cluster`=3 is not usable.*HINT"),
        (dict(cluster=""), "`cluster`='' is not usable.*HINT"),  # was read as the folder '.'
        (dict(cluster="."), "`cluster`='.' is a directory. HINT"),
        (dict(relocation=3), "`relocation`=3 is not usable.*HINT"),
        (dict(restart_spec=3), "`restart_spec` must be a file path, got 3.*HINT"),
        (dict(restart_spec="."), "`restart_spec`='.' is a directory. HINT: name a file in it"),
        (dict(allocator=["lbb"]), r"`allocator` must be one of .* got \['lbb'\]"),
        (dict(allocator=None), "`allocator`=None is not an allocator. HINT: leave it out for 'auto'"),
        (dict(apply_relocation="yes"), "`apply_relocation` must be True or False, got 'yes'.*HINT"),
        (dict(hosts_file="/nonexistent/hosts"), "`hosts_file`='/nonexistent/hosts' is not an existing file.*HINT"),
    ],
)
def test_options_are_checked_once_on_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalancingOptions(**kwargs)


@pytest.mark.parametrize("name", ["locality", "balance_eval", "log_metrics"])
def test_flags_refuse_strings_instead_of_reading_them_as_true(name):
    for make in (BalancingOptions, BatchBalancer, HeteroDDPStrategy):
        with pytest.raises(ValueError, match=f"`{name}` must be True or False, got 'no'.*HINT"):
            make(**{name: "no"})
    assert getattr(BalancingOptions(**{name: False}), name) is False
    assert getattr(BalancingOptions(**{name: 0}), name) is False  # the integers 0 and 1 stay accepted


def test_mistyped_keyword_names_the_closest_option():
    with pytest.raises(TypeError, match="BatchBalancer got an unexpected keyword argument 'allocater'. HINT: did "
                                        "you mean 'allocator'"):
        BatchBalancer(allocater="lbb")
    with pytest.raises(TypeError, match="HeteroDDPStrategy got an unexpected keyword argument 'halflife'. HINT: "
                                        "did you mean 'half_life'"):
        HeteroDDPStrategy(halflife=3)


def test_options_are_frozen_typed_and_normalised(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:1\n")
    opts = BalancingOptions(min_gain=0, half_life=3, locality=1, restart_spec=tmp_path / "spec.json", hosts_file=hosts)
    assert opts.min_gain == 0.0 and isinstance(opts.min_gain, float) and opts.half_life == 3.0
    assert opts.locality is True
    assert opts.restart_spec == str(tmp_path / "spec.json") and opts.hosts_file == str(hosts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.min_gain = 0.5  # type: ignore[misc]
    planner = BalancingOptions(allocator="lbb", min_batch_size=2, max_batch_size=40, warmup_steps=0).planner(
        world_size=3, global_batch=30, plan=[12, 10, 8])
    assert planner.plan == [12, 10, 8] and planner.allocator.name == "lbb"
    assert (planner.min_batch_size, planner.max_batch_size, planner.warmup_steps) == (2, 40, 0)
    assert planner.cliff_epochs == 4 and BalancingOptions(cliff_epochs=0).planner(2, 8).cliff_epochs == 0
    assert planner.regime_reset is True and BalancingOptions(regime_reset=False).planner(2, 8).regime_reset is False


def test_from_kwargs_pops_its_options_and_the_policy_alias():
    kwargs = {"policy": "lbb", "min_batch_size": 4, "log_metrics": False, "start_method": "spawn"}
    opts = BalancingOptions.from_kwargs(None, kwargs)
    assert kwargs == {"start_method": "spawn"}
    assert (opts.allocator, opts.min_batch_size, opts.log_metrics) == ("lbb", 4, False)
    assert BalancingOptions.from_kwargs(None, {"allocator": "lbb", "policy": "lbb"}).allocator == "lbb"
    with pytest.raises(ValueError, match="`allocator`='lbb' and `policy`='auto' disagree.*HINT"):
        BalancingOptions.from_kwargs(None, {"allocator": "lbb", "policy": "auto"})
    with pytest.raises(ValueError, match="`balancing` must be a BalancingOptions or None, got 'lbb'.*HINT"):
        BalancingOptions.from_kwargs("lbb", {})  # type: ignore[arg-type]


def test_from_kwargs_merges_a_keyword_onto_an_object_but_refuses_an_option_given_both_ways():
    base = BalancingOptions(allocator="lbb", min_gain=0.1)
    assert BalancingOptions.from_kwargs(base, {}) is base
    merged = BalancingOptions.from_kwargs(base, {"min_batch_size": 8})
    assert (merged.allocator, merged.min_gain, merged.min_batch_size) == ("lbb", 0.1, 8)
    with pytest.raises(ValueError, match="`min_gain` is given twice: 0.1 in `balancing` and 0.2 as a keyword.*HINT"):
        BalancingOptions.from_kwargs(base, {"min_gain": 0.2})
    with pytest.raises(ValueError, match="`allocator` is given twice"):
        BalancingOptions.from_kwargs(base, {"policy": "auto"})


def test_one_options_object_is_accepted_by_the_lightning_classes():
    opts = BalancingOptions(allocator="lbb", min_batch_size=2, memory_headroom=0.6, log_metrics=False, replan_every=None)
    for balancer in (BatchBalancer(opts), HeteroDDPStrategy(balancing=opts).balancer,
                     HeteroHorovodStrategy(balancing=opts).balancer):
        assert balancer.options == opts
        assert balancer.allocator.name == "lbb" and balancer.min_batch_size == 2 and balancer.replan_every is None
    # The keyword form builds the same options.
    assert BatchBalancer(allocator="lbb", min_batch_size=2, memory_headroom=0.6, log_metrics=False,
                         replan_every=None).options == opts


@pytest.mark.parametrize("strategy_cls", [HeteroDDPStrategy, HeteroHorovodStrategy])
def test_memory_headroom_and_log_metrics_reach_the_balancer_through_the_strategies(strategy_cls):
    strategy = strategy_cls(memory_headroom=0.5, log_metrics=False)
    assert strategy.balancer.memory_headroom == 0.5 and strategy.balancer.log_metrics is False
    default = strategy_cls()
    assert default.balancer.memory_headroom == 0.9 and default.balancer.log_metrics is True
    with pytest.raises(ValueError, match="`memory_headroom` must be <= 1.0"):
        strategy_cls(memory_headroom=2.0)


def test_strategies_keep_passing_other_keywords_through():
    s = HeteroDDPStrategy(allocator="lbb", start_method="spawn", process_group_backend="gloo")
    assert s._start_method == "spawn" and s._process_group_backend == "gloo"
    assert s.balancer.options.allocator == "lbb"


def test_hosts_file_is_refused_by_the_lightning_classes(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:1\n")
    for make in (lambda: BatchBalancer(hosts_file=hosts), lambda: HeteroDDPStrategy(hosts_file=hosts),
                 lambda: HeteroHorovodStrategy(balancing=BalancingOptions(hosts_file=hosts))):
        with pytest.raises(ValueError, match="`hosts_file`=.* does not apply to BatchBalancer.*HINT"):
            make()
    with pytest.raises(TypeError, match="unexpected keyword argument.*'min_batch'"):
        BatchBalancer(min_batch=3)


# ---------------------------------------------------------------------------------------------- PlanCoordinator
class ScriptedComm:
    """Rank ``rank`` of ``world`` in one process: the other ranks' contributions are scripted per collective."""

    def __init__(self, rank: int = 0, world: int = 1, others: dict | None = None, root: dict | None = None) -> None:
        self._rank, self._world = rank, world
        self.others = others or {}  # collective name -> the other ranks' arrays, rank order
        self.root = root or {}  # collective name -> what rank 0 broadcasts (seen by a rank other than 0)
        self.calls: list[str] = []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        self.calls.append(name)
        rows = [np.asarray(a, dtype=np.float64) for a in self.others.get(name, [])]
        rows.insert(self._rank, np.asarray(array, dtype=np.float64))
        return np.stack(rows)

    def broadcast_object(self, obj, name: str, root: int = 0):
        self.calls.append(name)
        return obj if self._rank == root else self.root[name]


def _records(batch: int, seconds: float, steps: int) -> np.ndarray:
    return np.array([[batch, seconds, 0.001]] * steps)


def test_end_epoch_on_one_rank_equals_the_planner_on_the_same_records():
    comm = ScriptedComm()
    coord = PlanCoordinator(BalancePlanner(world_size=1, global_batch=8), comm)
    entry = coord.end_epoch(0, _records(8, 0.1, 4), elapsed=0.5, memory_cap=20)
    reference = BalancePlanner(world_size=1, global_batch=8)
    expected = reference.end_epoch(0, _records(8, 0.1, 4)[None], epoch_time=0.5, memory_caps=[20])
    assert entry == expected and coord.planner.history == [entry]
    assert coord.planner.memory_caps == [20]
    assert comm.calls == ["hetero_plugins.header", "hetero_plugins.records", "hetero_plugins.plan"]


def test_every_rank_adopts_rank_0s_decision_and_record():
    # Rank 1's own planner would keep [8, 8]; rank 0 decided [12, 4] (it alone held the cluster context).
    decided = {"plan": [12, 4], "predicted_gain": 0.4, "plan_changed": True, "predicted_step_time": 0.12,
               "pending_reset": [1], "damping": {"change_factor": [8.0, 2.0], "last_move": [1, -1]},
               "relocation": {"epoch": 1, "moves": [[1, 0]]}}
    comm = ScriptedComm(rank=1, world=2, root={"hetero_plugins.plan": decided},
                        others={"hetero_plugins.header": [[5, 0.7, -1]], "hetero_plugins.records": [_records(8, 0.1, 5)]})
    coord = PlanCoordinator(BalancePlanner(world_size=2, global_batch=16, min_gain=0.99), comm, advisor=FakeAdvisor())
    entry = coord.end_epoch(3, _records(8, 0.1, 5), elapsed=0.6)
    assert coord.planner.plan == [12, 4] and coord.planner.predicted_step_time == 0.12
    assert coord.planner.pending_reset == [1]
    assert coord.planner.damping.state_dict() == decided["damping"]
    assert (entry["next_batch_sizes"], entry["predicted_gain"], entry["plan_changed"]) == ([12, 4], 0.4, True)
    assert entry["relocation"] == decided["relocation"] and entry["measured_epoch_time"] == 0.7
    assert coord.advisor.calls == []  # only rank 0 asks the advisor


def test_a_rank_that_reports_no_compute_time_is_named_once_with_the_fix():
    # Rank 1 ran its steps but its timing never did (0 s in every step): its batch could never move.
    untimed = np.array([[8, 0.0, 0.001]] * 5)
    comm = ScriptedComm(rank=0, world=2, others={"hetero_plugins.header": [[5, 0.7, -1]],
                                                 "hetero_plugins.records": [untimed]})
    coord = PlanCoordinator(BalancePlanner(world_size=2, global_batch=16), comm)
    with pytest.warns(RuntimeWarning, match=r"rank 1 reported 0 s of compute in every step of epoch 0, so its time "
                                            r"model learns nothing and its batch stays 8\. HINT: .*batch_sampler="):
        coord.end_epoch(0, _records(8, 0.1, 5), elapsed=0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per rank; a timed rank 1 or a rank that ran no step is not named
        coord.end_epoch(1, _records(8, 0.1, 5), elapsed=0.6)
        timed = ScriptedComm(rank=0, world=2, others={"hetero_plugins.header": [[5, 0.7, -1]],
                                                      "hetero_plugins.records": [_records(8, 0.05, 5)]})
        PlanCoordinator(BalancePlanner(world_size=2, global_batch=16), timed).end_epoch(0, _records(8, 0.1, 5), 0.6)


class FakeAdvisor:
    """An :class:`EpochAdvisor` that records its calls and proposes one relocation."""

    def __init__(self, problem: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.problem = problem

    def start(self, epoch, world_size, hosts=None):
        self.calls.append(("start", epoch, world_size))
        if self.problem:
            raise ValueError(self.problem)

    def before_decision(self, epoch, world_size, allocator, data, hosts=None):
        self.calls.append(("before", epoch, world_size, list(data), hosts))
        return "upcoming"

    def relocate(self, upcoming, planner, steps_per_epoch, epochs_left, data):
        self.calls.append(("relocate", upcoming, steps_per_epoch, epochs_left))
        return "decision", True

    def info(self, epoch, decision):
        return {"epoch": epoch, "moves": [[1, 0]], "spec": None}


def test_rank_0_asks_the_advisor_and_its_writer_acts_on_a_new_relocation():
    comm = ScriptedComm(rank=0, world=2, others={"hetero_plugins.header": [[4, 0.5, -1]],
                                                 "hetero_plugins.records": [np.array([[8, 0.4, 0.003]] * 4)]})
    advisor = FakeAdvisor()
    written = []

    def write(info, decision, upcoming):
        written.append((decision, upcoming))
        info["spec"] = "spec.json"

    coord = PlanCoordinator(BalancePlanner(world_size=2, global_batch=16), comm, advisor=advisor)
    entry = coord.end_epoch(2, _records(8, 0.1, 4), elapsed=0.4, epochs_left=7, hosts=["a", "b"],
                            write_relocation=write)
    assert advisor.calls[0] == ("before", 2, 2, pytest.approx([0.001, 0.003]), ["a", "b"])
    assert advisor.calls[1] == ("relocate", "upcoming", 4, 7)
    assert written == [("decision", "upcoming")]
    assert entry["relocation"] == {"epoch": 3, "moves": [[1, 0]], "spec": "spec.json"}
    assert entry["next_batch_sizes"][0] > entry["next_batch_sizes"][1]  # rank 1 is 4x slower


def test_mid_epoch_replans_are_kept_for_the_epoch_end_and_not_learned_twice():
    comm = ScriptedComm()
    coord = PlanCoordinator(BalancePlanner(world_size=1, global_batch=8, warmup_steps=0), comm)
    coord.begin_epoch()
    assert coord.replan(_records(8, 0.1, 3)) == [8]
    assert coord.replan(_records(8, 0.1, 2)) == [8]
    entry = coord.end_epoch(0, _records(8, 0.1, 4), elapsed=1.0, start_plan=[8],
                            annotations={"plan_changes": [{"step": 3, "batch_sizes": [8]}]})
    assert entry["samples"] == 8 * 9 and entry["plan_changes"] == [{"step": 3, "batch_sizes": [8]}]
    assert coord.planner.state_dict()["observed_steps"] == 9
    assert "hetero_plugins.replan" in comm.calls
    # A new epoch forgets the parts of one that did not end.
    coord.replan(_records(8, 0.1, 3))
    coord.begin_epoch()
    assert coord.end_epoch(1, _records(8, 0.1, 2), elapsed=1.0)["samples"] == 16


def test_uneven_step_counts_are_padded_or_cut_to_the_common_tail():
    others = {"hetero_plugins.header": [[2, 0.3, -1, 55.0]],
              "hetero_plugins.records": [np.array([[4, 0.2, 0.0], [4, 0.2, 0.0], [0, 0, 0]])]}
    padded = PlanCoordinator(BalancePlanner(world_size=2, global_batch=8), ScriptedComm(0, 2, others))
    entry = padded.end_epoch(0, _records(4, 0.1, 3), elapsed=0.3, local_extra=[12.0])
    assert entry["samples"] == 4 * 5
    assert padded.extras.tolist() == [[12.0], [55.0]]
    tail = {"hetero_plugins.header": [[2, 0.3, -1]], "hetero_plugins.records": [np.array([[4, 0.2, 0.0]] * 2)]}
    cut = PlanCoordinator(BalancePlanner(world_size=2, global_batch=8), ScriptedComm(0, 2, tail), align="tail")
    assert cut.end_epoch(0, _records(4, 0.1, 3), elapsed=0.3)["samples"] == 4 * 4
    empty = {"hetero_plugins.header": [[0, 0.0, -1]]}
    none = PlanCoordinator(BalancePlanner(world_size=2, global_batch=8), ScriptedComm(0, 2, empty), align="tail")
    with pytest.warns(RuntimeWarning, match="some ranks recorded no steps"):
        assert none.end_epoch(0, _records(4, 0.1, 3), elapsed=0.3) is None
    assert none.planner.history == [] and none.planner.plan == [4, 4]
    with pytest.raises(ValueError, match="`align` must be one of"):
        PlanCoordinator(BalancePlanner(world_size=1, global_batch=8), ScriptedComm(), align="trim")


def test_start_advisor_stops_every_rank_with_rank_0s_error():
    with pytest.raises(ValueError, match="bad cluster"):
        start_advisor(FakeAdvisor("bad cluster"), ScriptedComm(), 0, 1)
    follower = ScriptedComm(rank=1, world=2, root={"hetero_plugins.cluster": "bad cluster"})
    advisor = FakeAdvisor()
    with pytest.raises(ValueError, match="bad cluster"):
        start_advisor(advisor, follower, 0, 2)
    assert advisor.calls == []  # rank 1 does not read the description itself
    lone = ScriptedComm(rank=1, world=2)
    start_advisor(FakeAdvisor(), lone, 0, 2, collective=False)  # an elastic worker starting alone
    assert lone.calls == []


def test_data_times_and_gather_helpers():
    rec = np.array([[[4, 0.1, 0.02], [0, 0.0, 0.0]], [[4, 0.2, 0.01], [4, 0.2, 0.03]]])
    assert data_times(rec) == pytest.approx([0.02, 0.02])
    gathered, headers = gather_records(ScriptedComm(), _records(4, 0.1, 2), header=[7.0])
    assert gathered.shape == (1, 2, 3) and headers.tolist() == [[2.0, 7.0]]


def test_lightning_strategy_collectives_on_one_device():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from hetero_plugins.callbacks._collectives import StrategyCollectives
    from hetero_plugins.callbacks.straggler_monitor import gather_records as lightning_gather

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    comm = StrategyCollectives(strategy)
    assert (comm.rank(), comm.size()) == (0, 1)
    assert comm.allgather(np.arange(3.0), name="x").tolist() == [[0.0, 1.0, 2.0]]
    assert comm.broadcast_object({"a": 1}, name="y") == {"a": 1}
    assert comm.allreduce_sum_async(torch.ones(2), name="z").wait().tolist() == [1.0, 1.0]
    gathered, extras = lightning_gather(strategy, _records(4, 0.1, 3), extra=2.5)
    assert gathered.shape == (1, 3, 3) and extras.tolist() == [2.5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        coord = PlanCoordinator(BalancePlanner(world_size=1, global_batch=4), comm)
        assert coord.end_epoch(0, _records(4, 0.1, 3), elapsed=0.3)["samples"] == 12


def test_numpy_scalars_are_read_as_the_numbers_they_are():
    import numpy as np

    opts = BalancingOptions(min_batch_size=np.int64(8), min_gain=np.float32(0.05), locality=np.bool_(False))
    assert opts.min_batch_size == 8 and opts.locality is False


def test_the_other_callbacks_refuse_strings_for_log_metrics():
    from hetero_plugins.callbacks import LRAdapter, StragglerMonitor

    for make in (StragglerMonitor, LRAdapter):
        with pytest.raises(ValueError, match="`log_metrics` must be True or False, got 'no'.*HINT"):
            make(log_metrics="no")


def test_the_horovod_strategy_names_a_mistyped_keyword():
    from hetero_plugins.strategies import HeteroHorovodStrategy

    with pytest.raises(TypeError, match="unexpected keyword argument 'allocater'. HINT: did you mean 'allocator'"):
        HeteroHorovodStrategy(allocater="lbb")


@pytest.mark.parametrize("kwargs, match", [
    (dict(drop_last="False"), "`drop_last` must be True or False, got 'False'.*HINT"),  # was read as True
    (dict(shuffle="no"), "`shuffle` must be True or False, got 'no'.*HINT"),
    (dict(seed=1.9), "`seed` must be an int, got 1.9.*HINT"),  # was cut to 1
    (dict(replan_every=3), "`replan_every`=3 does not apply to .*HeteroBatchSampler.*HINT"),
    (dict(replan_every=5), "`replan_every`=5 does not apply"),  # Lightning's default, once silently ignored here
])
def test_the_horovod_sampler_refuses_what_it_used_to_coerce(kwargs, match):
    from hetero_plugins.horovod import HeteroBatchSampler

    with pytest.raises(ValueError, match=match):  # before Horovod is asked for the world
        HeteroBatchSampler(100, 8, **kwargs)


@pytest.mark.parametrize("make, match", [
    # The shared checks give every error a fix when the caller names none (these used to end at the value).
    (lambda: __import__("hetero_plugins.horovod", fromlist=["x"]).HeteroBatchSampler(0, 8),
     r"`num_samples` must be >= 1, got 0\. HINT: pass an int of at least 1, e.g\. num_samples=1\."),
    (lambda: BalancePlanner(2, 16.5), r"`global_batch` must be an int, got 16\.5 \(float\)\. HINT: pass an int"),
    (lambda: __import__("hetero_plugins.scheduler.relocation", fromlist=["x"]).Relocator(min_gain=-0.1),
     r"`min_gain` must be >= 0\.0, got -0\.1\. HINT: pass a finite number at least 0\.0\."),
    (lambda: HeteroDDPStrategy(timeout=30), r"got 30\. HINT: pass timeout=datetime\.timedelta\(seconds=30\), or None"),
    (lambda: HeteroDDPStrategy(timeout="10m"), r"HINT: pass timeout=datetime\.timedelta\(seconds=600\)"),
])
def test_argument_errors_name_a_fix_even_where_the_caller_gave_none(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_every_shared_check_names_the_argument_the_value_and_a_fix():
    from hetero_plugins import _validation as v

    bad = [lambda: v.check_int("n", "3"), lambda: v.check_int("n", 0, minimum=1),
           lambda: v.check_float("x", float("nan")), lambda: v.check_float("x", 0.0, minimum=0.0, strict_minimum=True),
           lambda: v.check_float("x", 2.0, maximum=1.0), lambda: v.check_bool("x", "False"),
           lambda: v.check_positive_floats("x", []), lambda: v.check_positive_floats("x", [1.0], length=2),
           lambda: v.check_positive_floats("x", [1.0, -1.0]), lambda: v.check_path("x", 5)]
    for make in bad:
        with pytest.raises(ValueError) as err:
            make()
        message = str(err.value)
        assert message.startswith(("`x`", "`n`", "`x[1]`")) and " got " in message, message
        assert message.count("HINT: ") == 1 and not message.endswith("HINT: "), message
    # A caller's own hint replaces the generic one.
    with pytest.raises(ValueError, match=r"HINT: use None to re-plan at epoch ends only\.$"):
        v.check_int("replan_every", 0, minimum=1, hint="use None to re-plan at epoch ends only.")


def test_a_mid_epoch_replan_interval_is_refused_with_locality():
    # With locality each rank keeps its shard for the epoch: an explicit interval was once ignored without a word.
    from hetero_plugins.strategies import HeteroDDPStrategy

    for make in (lambda: BalancingOptions(locality=True, replan_every=2),
                 lambda: HeteroDDPStrategy(locality=True, replan_every=2)):
        with pytest.raises(ValueError, match=r"`replan_every`=2 cannot apply with locality=True.*HINT"):
            make()
    assert BalancingOptions(locality=True).replan_every == 5 and BalancingOptions(locality=True, replan_every=None)
