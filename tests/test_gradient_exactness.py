"""Uneven per-rank batches + the weighted hook == one process stepping on the step's union (float64, 1e-9)."""

import pytest
import torch

from tests.helpers.distributed import run_distributed

PLAN = [3, 5]
STEPS = 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def step_data(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(PLAN), 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (sum(PLAN),), generator=g)
    return x, y


def _ddp_run(rank, world_size, use_hook):
    from torch.nn.parallel import DistributedDataParallel

    from hetero_plugins.callbacks.comm_hook import WeightedAllreduceState, weighted_allreduce_hook

    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)  # several buckets
    state = WeightedAllreduceState(PLAN[rank] / sum(PLAN))
    if use_hook:
        model.register_comm_hook(state, weighted_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    lo = sum(PLAN[:rank])
    for step in range(STEPS):
        x, y = step_data(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[lo : lo + PLAN[rank]]), y[lo : lo + PLAN[rank]])
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()], state.calls


def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for step in range(STEPS):
        x, y = step_data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.distributed
def test_weighted_hook_equals_single_process_on_union():
    ref = reference()
    results = run_distributed(_ddp_run, 2, True, timeout=120)
    for params, calls in results:
        assert calls > STEPS  # the hook really ran, on several buckets per step
        for p, r in zip(params, ref):
            assert torch.allclose(p, r, rtol=0, atol=1e-9), (p - r).abs().max()


@pytest.mark.distributed
def test_stock_averaging_is_not_exact_with_uneven_batches():
    # The control: DDP's default hook averages unweighted and misses the union's update.
    ref = reference()
    params, _ = run_distributed(_ddp_run, 2, False, timeout=120)[0]
    assert max((p - r).abs().max().item() for p, r in zip(params, ref)) > 1e-4


def _balancer_across_two_wrappers(rank, world_size):
    """A second ``fit`` in the same process wraps the module in a new DDP: the balancer must hook that one too."""
    from torch.nn.parallel import DistributedDataParallel

    from hetero_plugins.callbacks import BatchBalancer

    balancer = BatchBalancer()
    first = DistributedDataParallel(make_model())
    balancer.attach_ddp(first, world_size)
    balancer.attach_ddp(first, world_size)  # the same wrapper again: registered once (torch refuses twice)
    model = make_model()
    second = DistributedDataParallel(model)
    balancer.attach_ddp(second, world_size)
    balancer.hook_state.weight = PLAN[rank] / sum(PLAN)
    x, y = step_data(0)
    lo = sum(PLAN[:rank])
    torch.nn.functional.cross_entropy(second(x[lo : lo + PLAN[rank]]), y[lo : lo + PLAN[rank]]).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.distributed
def test_the_balancer_weights_the_gradients_of_a_second_fits_new_ddp_wrapper():
    model = make_model()
    x, y = step_data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for grads in run_distributed(_balancer_across_two_wrappers, 2, timeout=120):
        for g, r in zip(grads, (p.grad for p in model.parameters())):
            assert torch.allclose(g, r, rtol=0, atol=1e-12), (g - r).abs().max()
