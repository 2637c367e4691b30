import itertools

import numpy as np
import pytest
from torch.utils.data import BatchSampler, DataLoader, TensorDataset
import torch

from hetero_plugins.balancing.partition import epoch_layout, epoch_shards
from hetero_plugins.balancing.sampler import HeteroBatchSampler, HeteroDistributedSampler

CASES = list(itertools.product([1, 7, 64, 101, 1797], [[1], [3, 5], [32, 32, 16, 8], [1, 1, 1]], [False, True]))


@pytest.mark.parametrize("n, plan, drop_last", CASES)
@pytest.mark.parametrize("shuffle, locality", [(False, True), (True, True), (True, False), (False, False)])
def test_every_sample_once_for_every_rank(n, plan, drop_last, shuffle, locality):
    if drop_last and n + (-n) % len(plan) < sum(plan):
        with pytest.raises(ValueError, match="fewer than one global batch"):
            epoch_layout(n, plan, drop_last)
        return
    layout = epoch_layout(n, plan, drop_last)
    for epoch in (0, 3):
        shards = [
            list(HeteroDistributedSampler(n, plan, r, shuffle=shuffle, seed=5, drop_last=drop_last, locality=locality))
            for r in range(len(plan))
        ]
        flat = [i for s in shards for i in s]
        distinct = set(flat)
        if drop_last:
            assert len(flat) == layout.full_steps * sum(plan)  # the remainder dropped
            assert len(flat) - len(distinct) <= max(0, len(flat) - n)  # repeats only where padding was needed
        else:
            assert distinct == set(range(n))  # complete
            assert len(flat) == n + layout.padding  # disjoint except the documented padding
            assert layout.padding < 2 * len(plan)
        # every rank runs the same number of steps, and step k has step_counts(k) samples per rank
        batches = [list(HeteroBatchSampler(n, plan, r, shuffle=shuffle, seed=5, drop_last=drop_last, locality=locality))
                   for r in range(len(plan))]
        assert {len(b) for b in batches} == {layout.steps}
        assert {len(HeteroBatchSampler(n, plan, r, drop_last=drop_last)) for r in range(len(plan))} == {layout.steps}
        for k in range(layout.steps):
            assert tuple(len(b[k]) for b in batches) == layout.step_counts(k)


def test_shuffle_is_seeded_and_epoch_dependent():
    a = list(HeteroDistributedSampler(100, [30, 20], 0, seed=1))
    b = list(HeteroDistributedSampler(100, [30, 20], 0, seed=1))
    s = HeteroDistributedSampler(100, [30, 20], 0, seed=1)
    s.set_epoch(1)
    assert a == b and a != list(s) and len(a) == len(s)


def test_locality_keeps_most_of_the_shard_when_the_plan_changes():
    n = 1000
    before = [set(s.tolist()) for s in epoch_shards(n, [50, 50], epoch=0, seed=3, locality=True)]
    after = [set(s.tolist()) for s in epoch_shards(n, [55, 45], epoch=1, seed=3, locality=True)]
    kept = [len(b & a) / len(a) for b, a in zip(before, after)]
    assert min(kept) >= 0.9
    nonlocal_after = [set(s.tolist()) for s in epoch_shards(n, [55, 45], epoch=1, seed=3, locality=False)]
    assert min(len(b & a) / len(a) for b, a in zip(before, nonlocal_after)) < 0.7


def test_works_inside_a_batch_sampler_and_dataloader():
    ds = TensorDataset(torch.arange(20))
    inner = HeteroDistributedSampler(20, [6, 2], rank=1, shuffle=False)
    dl = DataLoader(ds, batch_sampler=BatchSampler(inner, batch_size=2, drop_last=False))
    assert [b[0].tolist() for b in dl] == [[6, 7], [14, 15], [19]]


def test_set_plan_validates():
    s = HeteroDistributedSampler(10, [5, 5], rank=1)
    with pytest.raises(ValueError, match="out of range"):
        s.set_plan([10])
    with pytest.raises(ValueError, match="batch size >= 1"):
        s.set_plan([10, 0])
    with pytest.raises(ValueError, match="num_samples"):
        HeteroDistributedSampler(0, [1], 0)


@pytest.mark.parametrize("n, world, b", [(1437, 4, 32), (359, 2, 16), (100, 3, 7), (64, 2, 32)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_step_unions_equal_distributed_samplers_for_any_plan(n, world, b, drop_last):
    """The default layout: step k's samples over all ranks are those of stock DDP's step k, whatever the plan."""
    from torch.utils.data import DistributedSampler

    stock = []
    for r in range(world):
        ds = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=7)
        ds.set_epoch(2)
        stock.append(list(BatchSampler(ds, b, drop_last)))
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, b * world), world - 1, replace=False))
    plan = np.diff(np.concatenate([[0], cuts, [b * world]])).tolist()
    ours = []
    for r in range(world):
        s = HeteroBatchSampler(n, plan, r, shuffle=True, seed=7, drop_last=drop_last)
        s.set_epoch(2)
        ours.append(list(s))
    assert len(ours[0]) == len(stock[0])
    for k in range(len(stock[0])):
        assert sorted(i for r in range(world) for i in ours[r][k]) == sorted(i for r in range(world) for i in stock[r][k])


@pytest.mark.parametrize("n, plan", [(359, [26, 6]), (359, [16, 16]), (10, [3, 4, 1]), (5, [4, 4])])
def test_evaluation_layout_pads_only_where_a_rank_would_be_empty(n, plan):
    layout = epoch_layout(n, plan, pad_to_world_size=False)
    flat = [i for r in range(len(plan)) for i in HeteroDistributedSampler(n, plan, r, shuffle=False, pad_to_world_size=False)]
    assert set(flat) == set(range(n)) and len(flat) == n + layout.padding
    rem = n % sum(plan)
    assert layout.padding == (len(plan) - rem if 0 < rem < len(plan) else 0)


def test_mid_epoch_plan_change_keeps_every_sample_once_and_the_step_unions():
    n, world = 1437, 4
    plan, new = [32, 32, 32, 32], [47, 47, 23, 11]
    samplers = [HeteroBatchSampler(n, plan, r, seed=3) for r in range(world)]
    iters = [iter(s) for s in samplers]
    steps = len(samplers[0])
    seen = [[next(it) for it in iters] for _ in range(4)]  # four steps drawn, then the plan changes
    for s in samplers:
        s.set_plan(new, from_step=6)
    seen += [[next(it) for it in iters] for _ in range(steps - 4)]
    assert [len(b) for b in seen[5]] == plan and [len(b) for b in seen[6]] == new
    assert [len(b) for b in seen[-1]] == list(samplers[0].step_counts(steps - 1))
    flat = [i for step in seen for batch in step for i in batch]
    assert sorted(set(flat)) == list(range(n)) and len(flat) == n + (-n) % world
    reference = [list(HeteroBatchSampler(n, plan, r, seed=3)) for r in range(world)]
    for k in range(steps):
        assert sorted(i for b in seen[k] for i in b) == sorted(i for r in range(world) for i in reference[r][k])
    samplers[0].set_epoch(1)
    assert samplers[0].plan == tuple(new) and samplers[0].plan_changes == []
    with pytest.raises(ValueError, match="global batch"):
        samplers[0].set_plan([1, 1, 1, 1], from_step=3)
    with pytest.raises(ValueError, match="locality=False"):
        HeteroBatchSampler(n, plan, 0, locality=True).set_plan(new, from_step=3)


def test_the_last_step_gives_every_rank_one_sample_and_at_most_its_plan():
    """Over every remainder of every plan of 2-4 ranks with batches 1-6, the last step's shares sum to the
    remainder, each between 1 and the rank's planned batch (a rank capped for memory is never handed more)."""
    from hetero_plugins.balancing.partition import split_remainder

    for w in (2, 3, 4):
        for plan in itertools.product(range(1, 7), repeat=w):
            for rem in range(w, sum(plan)):
                out = split_remainder(rem, plan)
                assert sum(out) == rem and all(1 <= c <= b for c, b in zip(out, plan)), (rem, plan, out)
    assert split_remainder(3, [1, 1, 4]) == [1, 1, 1]  # formerly [0, 1, 2]: an empty batch on rank 0
    assert split_remainder(14, [1, 8, 8, 8]) == [1, 5, 4, 4]  # formerly [2, 4, 4, 4]: twice rank 0's plan
    with pytest.raises(ValueError, match="each of 3 ranks"):
        split_remainder(2, [1, 1, 4])


@pytest.mark.parametrize("n, plan", [(67, [1, 1, 62]), (9, [1, 2, 2]), (1797, [1, 31, 1, 31])])
@pytest.mark.parametrize("locality", [False, True])
def test_plans_with_one_sample_ranks_keep_every_sample_once_and_the_steps_paired(n, plan, locality):
    batches = [list(HeteroBatchSampler(n, plan, r, shuffle=False, locality=locality)) for r in range(len(plan))]
    steps = len(HeteroBatchSampler(n, plan, 0, locality=locality))
    assert [len(b) for b in batches] == [steps] * len(plan)  # collectives pair up
    assert all(1 <= len(batch) <= plan[r] for r, b in enumerate(batches) for batch in b)
    flat = [i for b in batches for batch in b for i in batch]
    assert set(flat) == set(range(n)) and len(flat) == n + epoch_layout(n, plan).padding


def test_a_negative_resume_step_is_refused_by_name():
    s = HeteroBatchSampler(20, [3, 2], 0, shuffle=False)
    with pytest.raises(ValueError, match=r"`steps_done`=-2 .*HINT"):
        s.load_state_dict(s.state_dict(steps_done=-2))


def test_a_whole_epoch_plan_set_while_iterating_applies_from_the_next_epoch():
    """``set_plan(plan)`` (no ``from_step``) during an epoch's iteration leaves the running epoch's steps as they
    were (it used to cut them with the new counts but the old stride: samples 10 and 11 were lost)."""
    n = 12
    samplers = [HeteroBatchSampler(n, [3, 3], r, shuffle=False) for r in range(2)]
    iters = [iter(s) for s in samplers]
    seen = [next(it) for it in iters]  # step 0 drawn on both ranks
    for s in samplers:
        s.set_plan([2, 2])
        assert len(s) == 2 and s.step_counts(1) == (3, 3) and s.plan == (2, 2)
    seen += [b for it in iters for b in it]
    assert sorted(i for b in seen for i in b) == list(range(n)) and [len(b) for b in seen] == [3] * 4
    samplers[0].set_epoch(1)  # the next epoch runs the new plan
    samplers[1].set_epoch(1)
    nxt = [list(s) for s in samplers]
    assert [len(b) for b in nxt] == [3, 3] and sorted(i for b in nxt for x in b for i in x) == list(range(n))
    # a new iteration (without set_epoch) adopts it too; the state keeps the running epoch's plan and the next one
    s = HeteroBatchSampler(n, [3, 3], 0, shuffle=False)
    it = iter(s)
    next(it)
    s.set_plan([1, 3])
    state = s.state_dict(steps_done=1)
    assert state["plan"] == [3, 3] and state["next_plan"] == [1, 3] and next(it) == [6, 7, 8]
    assert list(s) == [[0], [4], [8]]
    fresh = HeteroBatchSampler(n, [3, 3], 0, shuffle=False)
    fresh.load_state_dict(state)
    assert list(fresh) == [[6, 7, 8]]  # the resumed epoch keeps its plan ...
    fresh.set_epoch(1)
    assert fresh.sampler.plan == (1, 3) and len(fresh) == 3  # ... and the next one runs the plan set for it


def test_from_step_zero_is_a_mid_epoch_change_with_its_checks():
    s = HeteroBatchSampler(12, [3, 3], 0, shuffle=False)
    it = iter(s)
    next(it)
    with pytest.raises(ValueError, match=r"global batch 6.*HINT"):
        s.set_plan([2, 2], from_step=0)  # used to pass as a whole-epoch plan, mid-iteration
    s.set_plan([4, 2], from_step=0)
    assert s.plan_changes == [(0, (4, 2))] and s.step_counts(1) == (4, 2) and next(it) == [6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"from_step.*HINT"):
        s.set_plan([4, 2], from_step=-1)


@pytest.mark.parametrize("n, plan", [(10, [3, 3]), (101, [7, 3, 2]), (37, [4, 4, 4])])
def test_locality_with_drop_last_drops_other_samples_every_epoch(n, plan):
    """With locality, shuffle and drop_last no sample is left out for good (the run-fixed order used to drop the
    same tail every epoch), each rank stays within its own region, and every epoch's guarantees hold."""
    layout = epoch_layout(n, plan, drop_last=True)
    visited, owned = set(), [set() for _ in plan]
    for epoch in range(60):
        shards = epoch_shards(n, plan, epoch=epoch, seed=2, shuffle=True, drop_last=True, locality=True)
        assert [len(s) for s in shards] == layout.shard_sizes()
        flat = np.concatenate(shards).tolist()
        assert len(flat) == len(set(flat))  # no repeats within an epoch
        visited |= set(flat)
        for r, s in enumerate(shards):
            owned[r] |= set(s.tolist())
    assert visited == set(range(n))
    assert all(not (a & b) for a, b in itertools.combinations(owned, 2))  # locality: disjoint regions
    assert all(len(o) - size <= b for o, size, b in zip(owned, layout.shard_sizes(), plan))  # region: < 1 batch more
    # without shuffle the drop is fixed, as DistributedSampler(shuffle=False) drops the same tail
    fixed = [epoch_shards(n, plan, epoch=e, shuffle=False, drop_last=True, locality=True) for e in (0, 1)]
    assert all((a == b).all() for a, b in zip(*fixed))


BAD_PLANS = [([2.9, 3.7], r"plan\[0\]` must be an int"), (["3", "3"], r"plan\[0\]` must be an int"),
             ([True, True], r"plan\[0\]` must be an int"), ([3, 0], r"plan\[1\]` must be >= 1"),
             ([], "every rank needs a batch size"), ("33", "sequence of per-rank batch sizes")]


@pytest.mark.parametrize("plan, message", BAD_PLANS)
def test_plans_are_validated_not_coerced(plan, message):
    from hetero_plugins.balancing.sampler import HeteroInferenceBatchSampler

    makers = [lambda: HeteroDistributedSampler(10, plan, 0), lambda: HeteroBatchSampler(12, plan, 0),
              lambda: HeteroBatchSampler(12, [3, 3], 0).set_plan(plan),
              lambda: HeteroBatchSampler(12, [3, 3], 0).set_plan(plan, from_step=1),
              lambda: epoch_layout(10, plan), lambda: HeteroInferenceBatchSampler(range(10), plan, 0)]
    for make in makers:
        with pytest.raises(ValueError, match=f"{message}.*HINT"):
            make()


def test_numpy_plans_are_accepted_and_plan_errors_give_a_hint():
    assert HeteroDistributedSampler(10, np.array([3, 2]), 1).plan == (3, 2)
    s = HeteroBatchSampler(12, [np.int64(3), np.int32(3)], 0)
    s.set_plan(np.array([4, 2], dtype=np.int64), from_step=1)
    assert s.plan == (4, 2) and all(type(b) is int for b in s.plan)
    with pytest.raises(ValueError, match=r"`rank`=2 is out of range.*HINT"):
        HeteroDistributedSampler(10, [3, 3], 2)
