"""The sample-weighted exchange carries the per-rank counts and backlogs exactly whatever the gradients' dtype.

bfloat16 holds integers exactly only up to 256 and float16 up to 2048; the counts ride in the gradients' buffer,
so a narrow dtype carries each as digits (``grad_sync.count_slots``) while float32 / float64 keep one slot per
count and the same maths. Ranks are threads of this process (``ThreadWorld`` of the aggregation tests): every
all-reduce really sums the ranks' buffers, in their dtype.
"""

from __future__ import annotations

import pytest
import torch

from hetero_plugins.aggregation.grad_sync import count_slots, sync_sample_weighted
from hetero_plugins.aggregation.options import AggregationOptions
from tests.test_aggregation_core import FixedTimes, ThreadWorld

NARROW = [torch.bfloat16, torch.float16]


def exchange(dtype, processed, planned, backlogs, grads=None):
    """Every rank runs :func:`sync_sample_weighted` on one parameter; per rank: (counts, backlogs, grad, sent),
    ``sent`` the buffer this rank handed the all-reduce. Without ``grads`` each sample's gradient is 1."""
    world = len(processed)

    def rank_fn(rank, comm):
        p = torch.zeros(2, dtype=dtype, requires_grad=True)
        p.grad = (grads[rank] if grads is not None else torch.full((2,), processed[rank] / planned)).to(dtype).clone()
        sent = []

        def allreduce(t):
            sent.append(t.clone())
            return comm.allreduce_sum(t, "test")

        counts, carried = sync_sample_weighted([p], processed[rank], planned, rank, world, allreduce,
                                               backlog=backlogs[rank])
        return counts, carried, p.grad.clone(), sent[0]

    return ThreadWorld(world).run(rank_fn)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("processed, backlogs", [
    ([300, 301], [0, 0]),
    ([5000, 1], [257, 2049]),
    ([5000, 70001, 3], [123457, 0, 2**40 + 3]),
])
def test_narrow_dtypes_carry_counts_and_backlogs_exactly(dtype, processed, backlogs):
    planned = sum(processed)
    for counts, carried, grad, _ in exchange(dtype, processed, planned, backlogs):
        assert counts == processed and carried == backlogs
        assert grad.dtype == dtype and grad.float().tolist() == pytest.approx([1.0, 1.0], rel=2e-2)


@pytest.mark.parametrize("dtype", NARROW)
def test_narrow_dtypes_rescale_by_the_exact_total(dtype):
    # 601 of 700 planned processed: the rescale must use N = 601 (a bfloat16 slot read 300 + 300 = 600)
    (counts, _, grad, _), _ = exchange(dtype, [300, 301], 700, [0, 0], grads=[torch.ones(2), torch.zeros(2)])
    assert counts == [300, 301]
    expected = (torch.ones(2, dtype=dtype) * (700 / 601)).float()
    assert torch.equal(grad.float(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_keep_one_slot_per_count_and_the_same_maths(dtype):
    assert count_slots(dtype) == (0, 1)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(2, generator=g, dtype=dtype) for _ in range(3)]
    processed, backlogs, planned = [300, 5001, 2], [7, 0, 70001], 6000
    results = exchange(dtype, processed, planned, backlogs, grads=grads)
    reference = grads[0].clone()
    for other in grads[1:]:
        reference += other
    reference.mul_(planned / sum(processed))
    for rank, (counts, carried, grad, sent) in enumerate(results):
        assert counts == processed and carried == backlogs
        assert torch.equal(grad, reference)  # bit for bit what the one-slot exchange always gave
        # the gradients, then one slot per count, per backlog and per layout fingerprint, then a has-grad flag
        assert sent.dtype == dtype and sent.numel() == 2 + 3 * 3 + 1
        slots = [0.0] * 6
        slots[rank], slots[3 + rank] = float(processed[rank]), float(backlogs[rank])
        assert sent[2:8].tolist() == slots
        assert sent[8 + rank].item() > 0 and sent[-1].item() == 1.0


def test_float64_step_equals_the_mean_over_the_union_of_samples():
    g = torch.Generator().manual_seed(5)
    processed, planned = [300, 301, 4999], 6000
    per_sample = [torch.randn(n, 2, generator=g, dtype=torch.float64) for n in processed]
    results = exchange(torch.float64, processed, planned, [0, 0, 0], grads=[s.sum(0) / planned for s in per_sample])
    union_mean = torch.cat(per_sample).mean(0)
    for _, _, grad, _ in results:
        assert (grad - union_mean).abs().max().item() < 1e-12


@pytest.mark.parametrize("mode", ["wbsp", "deadline"])
def test_bfloat16_engine_steps_past_256_samples_per_rank(mode):
    """A wbsp step used to raise a ClaimError blaming tampering (300 + 301 read as 600 of 601 planned)."""
    from hetero_plugins.aggregation import StepContext, make_aggregator

    plan = (300, 301)
    options = (AggregationOptions("wbsp", micro_batches=4) if mode == "wbsp"
               else AggregationOptions("deadline", deadline_slack=1e6, micro_batches=4))
    x = torch.ones(sum(plan), 3, dtype=torch.bfloat16)

    def share(owner):
        return list(range(sum(plan[:owner]), sum(plan[: owner + 1])))

    def rank_fn(rank, comm):
        w = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        agg = make_aggregator(options, comm, [w])
        agg.setup([opt])
        ctx = StepContext(0, plan, rank, last=True, planner=FixedTimes(1.0, [1.0, 1.0]), indices_of=share,
                          load=lambda idx: x[list(idx)])
        for mb in agg.micro_batches(x[share(rank)], ctx):
            ((mb.data @ w).sum() / sum(plan)).backward()
        agg.exchange(ctx)
        return agg.last_counts, agg.backlogs, w.grad.float().tolist(), agg.step_samples

    results = ThreadWorld(2).run(rank_fn)
    own = [r[3] for r in results]  # what each rank processed (wbsp: a rank may take the other's units)
    assert sum(own) == sum(plan) and (mode == "wbsp" or own == list(plan))
    for counts, backlogs, grad, _ in results:
        assert counts == own and backlogs == [0, 0]
        assert grad == pytest.approx([1.0] * 3, rel=2e-2)  # the mean over the 601 samples of d(x @ w)/dw = 1
