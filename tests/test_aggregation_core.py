"""The framework-free parts of the aggregation modes: options, micro-batches, claims, the exchange, re-routing."""

from __future__ import annotations

import doctest
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hetero_plugins.aggregation as aggregation_module
import hetero_plugins.aggregation.grad_sync as grad_sync_module
import hetero_plugins.aggregation.microbatch as microbatch_module
import hetero_plugins.aggregation.work_sharing as work_sharing_module
from hetero_plugins.aggregation.options import AGGREGATION_MODES, AggregationOptions, resolve_aggregation
from hetero_plugins.aggregation.grad_sync import sync_sample_weighted
from hetero_plugins.aggregation.local_sgd import weighted_average_
from hetero_plugins.aggregation.microbatch import (
    CarryQueue,
    DeadlineRule,
    MicroBatch,
    StepClaims,
    batch_length,
    micro_batch_sizes,
    split_batch,
    take_rows,
)
from hetero_plugins.balancing.planner import BalancePlanner


@pytest.mark.parametrize("module", [aggregation_module, microbatch_module, grad_sync_module, work_sharing_module])
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
    """Two threads play two ranks of one wbsp step; rank 1 is 6x slower per sample, so rank 0 steals."""
    import threading
    import time

    from hetero_plugins.aggregation.work_sharing import wbsp_micro_batches

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    counts, parts, cost = [16, 16], 8, [0.001, 0.006]
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
