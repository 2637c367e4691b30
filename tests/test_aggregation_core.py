"""The framework-free parts of the aggregation modes: options, micro-batches, claims, the exchange, re-routing."""

from __future__ import annotations

import copy
import doctest
import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hetero_plugins.aggregation as aggregation_module
import hetero_plugins.aggregation.base as base_module
import hetero_plugins.aggregation.deadline as deadline_module
import hetero_plugins.aggregation.grad_sync as grad_sync_module
import hetero_plugins.aggregation.microbatch as microbatch_module
import hetero_plugins.aggregation.options as options_module
import hetero_plugins.aggregation.wbsp as wbsp_module
import hetero_plugins.aggregation.weighted as weighted_module
from hetero_plugins.aggregation.options import AGGREGATION_MODES, AggregationOptions, resolve_aggregation
from hetero_plugins.aggregation.deadline import CarryQueue, DeadlineRule
from hetero_plugins.aggregation.grad_sync import sync_sample_weighted
from hetero_plugins.aggregation.local_sgd import weighted_average_
from hetero_plugins.aggregation.microbatch import MicroBatch, batch_length, micro_batch_sizes, split_batch, take_rows
from hetero_plugins.aggregation.wbsp import StepClaims
from hetero_plugins.balancing.planner import BalancePlanner


@pytest.mark.parametrize("module", [aggregation_module, base_module, deadline_module, grad_sync_module,
                                    microbatch_module, options_module, wbsp_module, weighted_module])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


def test_options_defaults_and_refusals():
    assert resolve_aggregation(None).mode == "weighted"
    assert AggregationOptions("deadline").deadline_slack == 0.5
    assert AggregationOptions("wbsp").micro_batches == 8
    assert AggregationOptions("local_sgd").local_steps == 4
    assert {AggregationOptions(m).explicit_sync for m in AGGREGATION_MODES} == {True, False}
    with pytest.raises(ValueError, match="`local_steps` does not apply to aggregation='deadline'"):
        AggregationOptions("deadline", local_steps=2)
    with pytest.raises(ValueError, match="micro_batches"):
        AggregationOptions("wbsp", micro_batches=0)
    with pytest.raises(ValueError, match="aggregation"):
        resolve_aggregation("fastest-k")
    assert AggregationOptions("deadline", deadline_slack=0.5).deadline(2.0) == pytest.approx(3.0)
    assert AggregationOptions("deadline").deadline(float("nan")) == math.inf


def test_micro_batches_cover_the_batch_in_order():
    batch = {"x": torch.arange(20).reshape(10, 2), "y": torch.arange(10), "names": [f"s{i}" for i in range(10)]}
    sizes = micro_batch_sizes(10, 4)
    assert sizes == [3, 3, 2, 2] and micro_batch_sizes(3, 8) == [1, 1, 1] and micro_batch_sizes(0, 4) == []
    pieces = split_batch(batch, sizes)
    assert torch.equal(torch.cat([p["y"] for p in pieces]), batch["y"])
    assert sum((p["names"] for p in pieces), []) == batch["names"]
    assert take_rows(batch, 2, 5)["names"] == ["s2", "s3", "s4"]
    with pytest.raises(ValueError, match="first dimensions"):
        batch_length((torch.zeros(3), torch.zeros(4)))


def test_deadline_rule_uses_this_steps_pace_and_always_runs_one():
    rule = DeadlineRule(1.0)
    assert rule.allows(5.0, 0, 100)  # the first micro-batch runs whatever the clock says
    assert rule.allows(0.4, 4, 4) and not rule.allows(0.6, 4, 4)
    assert DeadlineRule(math.inf).allows(1e9, 1, 10**6)
    q = CarryQueue()
    q.extend([MicroBatch(None, 3), MicroBatch(None, 4)])
    assert q.samples == 7 and [m.samples for m in q.take_all()] == [3, 4] and len(q) == 0


def test_claims_through_a_real_tcp_store_hand_out_each_unit_once():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    other = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    a, b = StepClaims(store, "s", [3, 5]), StepClaims(other, "s", [3, 5])
    taken = [(0, a.claim(0)), (0, b.claim(0))]
    assert list(b.claim_many(1, 4)) == [0, 1, 2, 3]
    while (got := a.steal(exclude=0)) is not None:
        taken.append(got)
    taken.append((0, a.claim(0)))
    assert a.claim(0) is None and a.left() == 0 and list(a.claim_many(1, 3)) == []
    assert sorted(taken) == [(0, 0), (0, 1), (0, 2), (1, 4)]


def _simulate(world, fn):
    """Run ``fn(rank, allreduce)`` for every rank in lockstep threads: each all-reduce sums all ranks' tensors."""
    import threading

    barrier = threading.Barrier(world)
    slots: list = [None] * world
    results: list = [None] * world

    def allreduce_for(rank):
        def allreduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            t.copy_(total)
            return t
        return allreduce

    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(r, allreduce_for(r)))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_sample_weighted_exchange_weights_sum_to_one_and_carry_counts():
    processed, planned = [5, 2, 9], 20

    def rank_fn(rank, allreduce):
        p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        p.grad = torch.zeros(3, dtype=torch.float64)
        p.grad[rank] = processed[rank] / planned  # a "sum of per-sample gradients" of 1 per sample, over B
        counts, backlogs = sync_sample_weighted([p], processed[rank], planned, rank, 3, allreduce, backlog=rank * 10)
        return p.grad.tolist(), counts, backlogs

    for grad, counts, backlogs in _simulate(3, rank_fn):
        assert counts == processed and backlogs == [0, 10, 20]
        assert grad == pytest.approx([n / sum(processed) for n in processed], abs=1e-15)  # weights n_i / N
        assert sum(grad) == pytest.approx(1.0, abs=1e-15)


def test_local_sgd_average_weights_sum_to_one():
    samples = [3, 0, 7]

    def rank_fn(rank, allreduce):
        t = torch.zeros(3, dtype=torch.float64)
        t[rank] = 1.0
        info = weighted_average_([t], samples[rank], allreduce)
        return t.tolist(), info["total_samples"]

    for values, total in _simulate(3, rank_fn):
        assert total == 10 and values == pytest.approx([0.3, 0.0, 0.7], abs=1e-15)


def test_backlog_rerouting_keeps_the_global_batch():
    p = BalancePlanner(world_size=4, global_batch=128, initial_plan=[46, 46, 24, 12])
    assert p.plan_with_backlog([0, 0, 0, 0]) == [46, 46, 24, 12]
    routed = p.plan_with_backlog([0, 20, 0, 0])
    assert sum(routed) == 128 and routed[1] == 26 and routed[0] > 46 and routed[3] >= 12
    assert p.plan_with_backlog([0, 500, 0, 0])[1] == 1  # never below min_batch_size
    assert sum(p.plan_with_backlog([5, 5, 5, 5])) == 128


def test_wbsp_ranks_share_a_step_through_a_tcp_store_each_unit_once():
    """Two threads play two ranks of one wbsp step; rank 1 is 25x slower per sample, so rank 0 steals.

    The slow rank's own share takes 0.8 s against the fast rank's 32 ms, and both start together at a barrier
    (after the client store connects), so the stealing does not hang on scheduling noise of a busy machine."""
    import threading
    import time

    from hetero_plugins.aggregation.wbsp import wbsp_micro_batches

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    counts, parts, cost = [16, 16], 8, [0.002, 0.05]
    ready = threading.Barrier(2, timeout=20)
    batches = [torch.arange(16) + 16 * r for r in range(2)]  # sample ids: rank r's share is 16r .. 16r+15
    seen: list[list[int]] = [[], []]

    def rank_fn(rank):
        store = server if rank == 0 else dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                       timeout=timedelta(seconds=10))
        claims = StepClaims(store, "step", [len(micro_batch_sizes(c, parts)) for c in counts])

        def load(owner, index):  # what a thief reads from the dataset: the owner's unit `index`
            sizes = micro_batch_sizes(counts[owner], parts)
            lo = sum(sizes[:index])
            return batches[owner][lo : lo + sizes[index]], sizes[index]

        ready.wait()
        for mb in wbsp_micro_batches(batches[rank], counts, parts, rank, claims, load, [1 / cost[0], 1 / cost[1]]):
            time.sleep(cost[rank] * mb.samples)
            seen[rank] += mb.data.tolist()

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(seen[0] + seen[1]) == list(range(32))  # every sample of the step once
    assert len([i for i in seen[0] if i >= 16]) > 0  # the fast rank took units of the slow rank's share
    assert len(seen[0]) > len(seen[1])


# ------------------------------------------------------------------------------------------------ the engine
class ThreadComm:
    """A :class:`~hetero_plugins.collectives.Collectives` for ranks played by threads of one process: every
    collective meets at a barrier, sums add the ranks' tensors in rank order."""

    def __init__(self, world: "ThreadWorld", rank: int) -> None:
        self.world, self._rank = world, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    def _meet(self, value):
        w = self.world
        w.slots[self._rank] = value
        w.barrier.wait()
        out = list(w.slots)
        w.barrier.wait()
        return out

    def allgather(self, array, name):
        import numpy as np

        return np.stack(self._meet(np.asarray(array, dtype=np.float64)))

    def broadcast_object(self, obj, name, root=0):
        return self._meet(obj)[root]

    def allreduce_sum(self, tensor, name):
        parts = self._meet(tensor.detach().clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        tensor.copy_(total)
        return tensor

    def allreduce_sum_async(self, tensor, name):
        from hetero_plugins.collectives import CompletedHandle

        return CompletedHandle(self.allreduce_sum(tensor, name))

    def store_host(self) -> str:
        return "127.0.0.1"


class ThreadWorld:
    def __init__(self, size: int) -> None:
        import threading

        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list = [None] * size

    def run(self, fn):
        import threading

        results: list = [None] * self.size
        errors: list = []

        def target(rank):
            try:
                results[rank] = fn(rank, ThreadComm(self, rank))
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results


class FixedTimes:
    """The plan's time models as the engine asks them (``BalancePlanner`` answers the same two questions)."""

    def __init__(self, step_time: float, rates: list[float]) -> None:
        self.step_time, self._rates = step_time, rates

    def predict_step_time(self, plan):
        return self.step_time

    def rates(self, plan):
        return list(self._rates)


PLAN, STEPS = (5, 3), 6
GLOBAL = sum(PLAN)


def engine_data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(GLOBAL * STEPS, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (GLOBAL * STEPS,), generator=g)
    return x, y


def engine_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def share(step: int, owner: int) -> list[int]:
    lo = step * GLOBAL + sum(PLAN[:owner])
    return list(range(lo, lo + PLAN[owner]))


def run_engine(options, sleep=None, times=None):
    """Every rank drives its aggregator the way both adapters do; returns per rank (model, stats, processed)."""
    from hetero_plugins.aggregation import StepContext, make_aggregator

    x, y = engine_data()
    initial = engine_model()  # built here: threads would share torch's global generator

    def rank_fn(rank, comm):
        model = copy.deepcopy(initial)
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
        agg = make_aggregator(options, comm, model.parameters(), buffers=list(model.buffers()))
        agg.setup([opt])
        processed: list[list[int]] = []
        for step in range(STEPS):
            own = share(step, rank)
            ctx = StepContext(step, PLAN, rank, last=step + 1 == STEPS, planner=times,
                              indices_of=lambda owner, s=step: share(s, owner),
                              load=lambda idx: (x[list(idx)], y[list(idx)], torch.tensor(list(idx))))
            opt.zero_grad()
            done: list[int] = []
            for mb in agg.micro_batches((x[own], y[own], torch.tensor(own)), ctx):
                xb, yb, ib = mb.data
                if sleep is not None:
                    time.sleep(sleep(rank, step, mb.samples))
                (torch.nn.functional.cross_entropy(model(xb), yb) * mb.weight).backward()
                done += ib.tolist()
            if agg.exchange(ctx):
                opt.step()
            agg.after_step(ctx)
            processed.append(done)
        if agg.flush():
            opt.step()
        return model, agg.stats, processed, agg

    return ThreadWorld(2).run(rank_fn)


def replay_unions(unions, delayed=False):
    x, y = engine_data()
    model = engine_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    params = list(model.parameters())
    pending = None
    for idx in unions:
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x[idx]), y[idx]), params)
        apply, pending = (pending, grads) if delayed else (grads, None)
        if apply is not None:
            for p, g in zip(params, apply):
                p.grad = g.clone()
            opt.step()
    if delayed and pending is not None:
        for p, g in zip(params, pending):
            p.grad = g.clone()
        opt.step()
    return model


def assert_models_close(a, b, tol=1e-9):
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p - q).abs().max().item() < tol


def test_registry_covers_every_mode_and_builds_by_name():
    from hetero_plugins.aggregation import AGGREGATORS, make_aggregator

    assert tuple(AGGREGATORS) == AGGREGATION_MODES
    for mode, cls in AGGREGATORS.items():
        agg = make_aggregator(mode, ThreadComm(ThreadWorld(1), 0), [])
        assert type(agg) is cls and agg.mode == mode and agg.micro_batched == AggregationOptions(mode).micro_batched
    with pytest.raises(ValueError, match="HINT"):
        make_aggregator("fastest", ThreadComm(ThreadWorld(1), 0), [])
    with pytest.raises(ValueError, match="implements aggregation='wbsp'"):
        AGGREGATORS["wbsp"](AggregationOptions("deadline"), ThreadComm(ThreadWorld(1), 0), [])


def test_shared_checks_name_the_argument_value_and_fix():
    with pytest.raises(ValueError, match=r"`backward_passes_per_step`=2 .*aggregation='pseudo_sync'.*HINT"):
        AggregationOptions("pseudo_sync").check_accumulation("backward_passes_per_step", 2)
    AggregationOptions("weighted").check_accumulation("accumulate_grad_batches", 4)  # the framework accumulates
    with pytest.raises(ValueError, match=r"aggregation='deadline'.*`locality=True`.*HINT"):
        AggregationOptions("deadline").check_locality(True)
    AggregationOptions("local_sgd").check_locality(True)


def test_engine_deadline_without_a_hit_and_wbsp_equal_one_process_on_each_union():
    unions = [share(s, 0) + share(s, 1) for s in range(STEPS)]
    ref = replay_unions(unions)
    for options in (AggregationOptions("deadline", deadline_slack=1e6, micro_batches=2),
                    AggregationOptions("wbsp", micro_batches=3)):
        results = run_engine(options, sleep=lambda rank, step, n: 0.004 * n * rank,
                             times=FixedTimes(1.0, [1000.0, 100.0]))
        for model, stats, processed, _ in results:
            assert_models_close(model, ref)
            # the exchange counts what it sends: the gradients, 3 * world float64 slots (count, backlog, layout
            # fingerprint), one has-gradient flag per parameter tensor (wbsp: and one tally slot per micro-batch
            # of the step, 3 per rank here)
            n = sum(p.numel() for p in model.parameters()) + (2 * 3 if options.mode == "wbsp" else 0)
            flags = len(list(model.parameters()))
            assert stats.rounds == STEPS and stats.bytes == STEPS * (n + 3 * 2 + flags) * 8
        seen = sorted(i for _, _, processed, _ in results for step in processed for i in step)
        assert seen == list(range(GLOBAL * STEPS))  # every sample once


def test_engine_deadline_carries_a_stalled_ranks_samples_and_each_step_is_exact():
    # Margins far above scheduling noise on a loaded 2-core machine: the on-time rank needs well under its
    # 0.25 s deadline, the stalled one sleeps past it at its first micro-batch.
    stall = lambda rank, step, n: 0.8 if (rank == 1 and step in (1, 2)) else 0.0  # noqa: E731
    results = run_engine(AggregationOptions("deadline", deadline_slack=0.0, micro_batches=3), sleep=stall,
                         times=FixedTimes(0.25, [1.0, 1.0]))
    (m0, s0, p0, a0), (m1, s1, p1, _) = results
    assert s1.carried > 0 and s0.carried == 0
    unions = [p0[s] + p1[s] for s in range(STEPS)]
    assert any(len(u) < GLOBAL for u in unions)  # steps that updated on fewer samples than planned
    assert sorted(i for u in unions for i in u) == list(range(GLOBAL * STEPS))  # the last step works off the carry
    assert a0.backlogs == [0, 0] and len(a0.carry) == 0
    ref = replay_unions(unions)
    assert_models_close(m0, ref)
    assert_models_close(m1, ref)


def test_engine_wbsp_claim_keys_live_two_steps_in_their_namespace():
    results = run_engine(AggregationOptions("wbsp", micro_batches=2), times=FixedTimes(1.0, [1.0, 1.0]))
    store = results[0][3].store
    assert not store.check([f"hetero_plugins/wbsp/{STEPS - 3}/0"])  # deleted two steps later
    assert store.check([f"hetero_plugins/wbsp/{STEPS - 1}/0", f"hetero_plugins/wbsp/{STEPS - 2}/1"])


def test_engine_pseudo_sync_plain_delay_equals_one_step_delayed_sgd():
    results = run_engine(AggregationOptions("pseudo_sync", min_confidence=1.0))
    ref = replay_unions([share(s, 0) + share(s, 1) for s in range(STEPS)], delayed=True)
    for model, stats, _, _ in results:
        assert_models_close(model, ref)
        # the gradients, one has-gradient flag per parameter tensor and one layout-fingerprint slot per rank
        params = list(model.parameters())
        assert stats.rounds == STEPS and stats.bytes == STEPS * (sum(p.numel() for p in params) + len(params) + 2) * 8


def test_engine_local_sgd_averages_every_h_steps_weighted_by_samples_and_at_the_end():
    h = 4
    results = run_engine(AggregationOptions("local_sgd", local_steps=h))
    x, y = engine_data()
    locals_ = []
    for _ in range(2):
        m = engine_model()
        locals_.append((m, torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.5)))
    samples = [0, 0]
    for step in range(STEPS):
        for r, (m, opt) in enumerate(locals_):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x[share(step, r)]), y[share(step, r)]).backward()
            opt.step()
            samples[r] += PLAN[r]
        if (step + 1) % h == 0 or step + 1 == STEPS:
            with torch.no_grad():
                for tensors in zip(*(m.parameters() for m, _ in locals_)):
                    avg = sum(t * (n / sum(samples)) for t, n in zip(tensors, samples))
                    for t in tensors:
                        t.copy_(avg)
            samples = [0, 0]
    for model, stats, _, _ in results:
        assert stats.rounds == 2  # after step 4 and at the epoch's last step
        assert_models_close(model, locals_[0][0])


def test_aggregation_core_imports_no_framework():
    import pathlib
    import re

    root = pathlib.Path(aggregation_module.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(lightning|horovod|torch\.distributed)\b", text, re.M), path
