"""Regressions of the aggregation review: unused and mixed-dtype parameters, a trainable set that changes during
the fit, the end of a fit inside a window (``max_steps``), ``pseudo_sync``'s final flush and fp16 loss scale, and
aggregator state in checkpoints.

The engine tests run the ranks as threads of this process (``ThreadWorld``: every all-reduce really sums the
ranks' buffers); the Lightning tests start 2 (or 1) fresh gloo ranks through ``HeteroDDPStrategy``, each rank
saving what it ended with to ``tmp_path``.
"""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

import hetero_plugins.strategies  # noqa: F401
from hetero_plugins.aggregation import AggregationOptions, StepContext, make_aggregator
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.helpers.distributed import START_METHOD
from tests.test_aggregation_core import FixedTimes, ThreadWorld


# ---------------------------------------------------------------------- the engine (ranks as threads)
def _step(agg, model_loss, batch, ctx):
    """One step as the adapters drive it; returns whether the optimizer must step."""
    if agg.micro_batched:
        for mb in agg.micro_batches(batch, ctx):
            (model_loss(mb.data) * mb.weight).backward()
    else:
        model_loss(batch).backward()
    return agg.exchange(ctx)


@pytest.mark.parametrize("mode", ["deadline", "wbsp", "pseudo_sync"])
def test_a_parameter_no_rank_has_a_gradient_for_keeps_none_and_does_not_move(mode):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)
    plan = (8, 8)

    def rank_fn(rank, comm):
        torch.manual_seed(0)
        used, unused = torch.nn.Linear(3, 1).double(), torch.nn.Linear(3, 1).double()
        params = list(used.parameters()) + list(unused.parameters())
        before = [p.detach().clone() for p in unused.parameters()]
        opt = torch.optim.SGD(params, lr=0.1, weight_decay=0.1, momentum=0.5)
        agg = make_aggregator(AggregationOptions(mode), comm, params)
        agg.setup([opt])
        rows = list(range(8 * rank, 8 * rank + 8))
        for step in range(3):
            ctx = StepContext(step, plan, rank, last=step == 2, planner=FixedTimes(1e6, [1.0, 1.0]),
                              indices_of=lambda owner: list(range(8 * owner, 8 * owner + 8)),
                              load=lambda idx: (x[list(idx)], y[list(idx)]))
            opt.zero_grad(set_to_none=True)
            if _step(agg, lambda b: torch.nn.functional.mse_loss(used(b[0]), b[1]), (x[rows], y[rows]), ctx):
                assert all(p.grad is None for p in unused.parameters())
                assert all(p.grad is not None for p in used.parameters())
                opt.step()
        return [torch.equal(p.detach(), b) for p, b in zip(unused.parameters(), before)]

    for unchanged in ThreadWorld(2).run(rank_fn):
        assert unchanged == [True, True]  # weight decay and momentum did not move it


def test_a_parameter_with_a_gradient_on_one_rank_only_gets_the_summed_gradient_on_both():
    def rank_fn(rank, comm):
        a = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        agg = make_aggregator("deadline", comm, [a, b])
        agg.setup([torch.optim.SGD([a, b], lr=0.1)])
        ctx = StepContext(0, (2, 2), rank, last=True)
        for mb in agg.micro_batches(torch.ones(2, 1, dtype=torch.float64), ctx):
            loss = (mb.data.sum() * a.sum()) if rank == 0 else (mb.data.sum() * (a.sum() + b.sum()))
            (loss * mb.weight / mb.samples).backward()
        agg.exchange(ctx)
        return a.grad.tolist(), None if b.grad is None else b.grad.tolist()

    for a, b in ThreadWorld(2).run(rank_fn):
        assert a == pytest.approx([1.0, 1.0]) and b == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize("mode", ["deadline", "pseudo_sync"])
@pytest.mark.parametrize("first", [torch.bfloat16, torch.float32])
def test_mixed_dtypes_are_exchanged_in_the_widest_dtype(mode, first):
    torch.manual_seed(0)
    emb0 = torch.randn(3, dtype=first)
    head0 = torch.randn(3, dtype=torch.float64)
    x = torch.randn(8, 3, dtype=torch.float64)

    def loss(xb, emb, head):
        return ((xb * head).sum(1) + emb.double().sum()).pow(2).mean()

    def rank_fn(rank, comm):
        emb, head = torch.nn.Parameter(emb0.clone()), torch.nn.Parameter(head0.clone())
        agg = make_aggregator(mode, comm, [emb, head])
        agg.setup([torch.optim.SGD([emb, head], lr=0.1)])
        rows = x[4 * rank : 4 * rank + 4]
        applied = None
        for step in range(2):  # pseudo_sync applies step 0's gradient at step 1
            emb.grad = head.grad = None
            ctx = StepContext(step, (4, 4), rank, last=step == 1, planner=FixedTimes(1e6, [1.0, 1.0]))
            if _step(agg, lambda b: loss(b, emb, head), rows, ctx):
                applied = head.grad.clone()
        return applied

    ref_head = torch.nn.Parameter(head0.clone())
    ref = torch.autograd.grad(loss(x, emb0, ref_head), ref_head)[0]
    for got in ThreadWorld(2).run(rank_fn):
        assert got.dtype == torch.float64
        assert (got - ref).abs().max().item() < 1e-12  # was ~1e-3 (bfloat16) / ~1e-8 (float32) off


@pytest.mark.parametrize("mode", ["deadline", "pseudo_sync"])
def test_ranks_that_train_different_parameters_fail_naming_requires_grad(mode):
    def rank_fn(rank, comm):
        a = torch.zeros(2, dtype=torch.float64, requires_grad=rank == 0)
        b = torch.zeros(2, dtype=torch.float64, requires_grad=rank == 1)  # same size: the buffers match
        agg = make_aggregator(mode, comm, [a, b])
        agg.setup([torch.optim.SGD([a, b], lr=0.1)])
        for step in range(2):
            ctx = StepContext(step, (2, 2), rank, last=step == 1)
            _step(agg, lambda d: d.sum() * (a.sum() + b.sum()), torch.ones(2, 1, dtype=torch.float64), ctx)

    with pytest.raises(RuntimeError, match=r"different sets of trainable parameters.*requires_grad"):
        ThreadWorld(2).run(rank_fn)


def test_an_aggregator_that_does_not_follow_the_optimizer_refuses_a_change_of_trainable_parameters():
    def rank_fn(rank, comm):
        a = torch.zeros(2, requires_grad=True)
        frozen = torch.zeros(2, requires_grad=False)
        agg = make_aggregator("deadline", comm, [a, frozen])  # follow_optimizer=False (the Horovod optimizer)
        agg.setup([torch.optim.SGD([a, frozen], lr=0.1)])
        assert len(agg.params) == 1
        frozen.requires_grad_(True)
        return agg.params

    with pytest.raises(ValueError, match=r"trainable parameters changed.*HINT: build the optimizer again"):
        ThreadWorld(1).run(rank_fn)


def test_pseudo_sync_state_dict_carries_the_gradient_in_flight():
    torch.manual_seed(0)
    model0 = torch.nn.Linear(3, 1).double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def rank_fn(rank, comm):
        model = copy.deepcopy(model0)
        agg = make_aggregator(AggregationOptions("pseudo_sync", smoothing=0.5, min_confidence=0.0), comm,
                              list(model.parameters()))
        agg.setup([torch.optim.SGD(model.parameters(), lr=0.1)])
        for step in range(3):
            model.zero_grad(set_to_none=True)
            _step(agg, lambda b: model(b).pow(2).mean() * (step + 1), x, StepContext(step, (4,), rank))
        state = agg.state_dict()
        twin = copy.deepcopy(model)
        other = make_aggregator(AggregationOptions("pseudo_sync", smoothing=0.5, min_confidence=0.0), comm,
                                list(twin.parameters()))
        other.setup([torch.optim.SGD(twin.parameters(), lr=0.1)])
        other.load_state_dict(state)
        assert agg.flush() and other.flush()
        return [p.grad.clone() for p in model.parameters()], [p.grad.clone() for p in twin.parameters()]

    ((mine, restored),) = ThreadWorld(1).run(rank_fn)
    for a, b in zip(mine, restored):
        assert torch.equal(a, b)


def test_local_sgd_flush_averages_a_window_the_fit_left_unfinished():
    def rank_fn(rank, comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        agg = make_aggregator(AggregationOptions("local_sgd", local_steps=4), comm, list(model.parameters()))
        agg.setup([opt])
        x = torch.full((2, 3), float(rank + 1), dtype=torch.float64)
        for step in range(3):  # the fit stops after 3 of H=4 local steps
            opt.zero_grad()
            if _step(agg, lambda b: model(b).sum(), x, StepContext(step, (2, 2), rank)):
                opt.step()
            agg.after_step(StepContext(step, (2, 2), rank))
        before = model.weight.detach().clone()
        assert agg.flush() is False
        return before, model.weight.detach().clone()

    (before0, after0), (before1, after1) = ThreadWorld(2).run(rank_fn)
    assert not torch.equal(before0, before1)  # the local models had drifted apart
    assert torch.equal(after0, after1) and torch.allclose(after0, (before0 + before1) / 2)


def test_deadline_names_the_carried_samples_a_checkpoint_cannot_hold():
    def rank_fn(rank, comm):
        w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        agg = make_aggregator(AggregationOptions("deadline", micro_batches=4, deadline_slack=0.0), comm, [w])
        agg.setup([torch.optim.SGD([w], lr=0.1)])
        ctx = StepContext(0, (8,), rank, last=False, planner=FixedTimes(1e-9, [1.0]))  # every step overruns
        for mb in agg.micro_batches(torch.ones(8, 3, dtype=torch.float64), ctx):
            ((mb.data @ w).sum() * mb.weight).backward()
        agg.exchange(ctx)
        return agg.checkpoint_losses(), agg.carry.samples

    ((lost, carried),) = ThreadWorld(1).run(rank_fn)
    assert carried > 0 and lost is not None and f"{carried} samples carried" in lost


# ---------------------------------------------------------------------- Lightning (fresh gloo ranks)
_g = torch.Generator().manual_seed(0)
X = torch.randn(128, 4, generator=_g, dtype=torch.float64)
Y = torch.randn(128, 1, generator=_g, dtype=torch.float64)


class Net(pl.LightningModule):
    """A tiny float64 regression: a backbone (frozen with ``freeze=True``) and a head."""

    def __init__(self, freeze: bool = False, lr: float = 0.1, samples: int = 128, dtype=torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Linear(4, 4).to(dtype)
        self.head = torch.nn.Linear(4, 1).to(dtype)
        self.backbone.requires_grad_(not freeze)
        self.lr, self.samples, self.dtype_ = lr, samples, dtype
        self.hook_calls = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.backbone(x))).float(), y.float())

    def on_before_optimizer_step(self, optimizer):
        self.hook_calls += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        n = self.samples
        return DataLoader(TensorDataset(X[:n].to(self.dtype_), Y[:n].to(self.dtype_)), batch_size=16, shuffle=False)


class Unfreeze(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.backbone.requires_grad_(True)


class Moves(Callback):
    """Each step's parameter move, the move of the strategy's final flush, and the model each rank ends with."""

    def __init__(self, out: str) -> None:
        self.out, self.moves = out, []

    @staticmethod
    def _flat(m):
        return torch.cat([p.detach().flatten().clone().double() for p in m.parameters()])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = self._flat(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.moves.append((self._flat(pl_module) - self.before).norm().item())

    def on_train_end(self, trainer, pl_module):
        self.before = self._flat(pl_module)  # the strategy's on_train_end (the flush) runs after the callbacks'

    def on_fit_end(self, trainer, pl_module):
        torch.save({"state": {k: v.clone() for k, v in pl_module.state_dict().items()}, "moves": self.moves,
                    "flush_move": (self._flat(pl_module) - self.before).norm().item(),
                    "hook_calls": pl_module.hook_calls, "global_step": trainer.global_step},
                   os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def _fit(tmp_path, aggregation, devices=2, callbacks=(), ckpt_path=None, plugins=None, **trainer_kw):
    out = str(tmp_path / "out")
    os.makedirs(out, exist_ok=True)
    for f in glob.glob(os.path.join(out, "rank*.pt")):
        os.remove(f)
    model = trainer_kw.pop("model", None) or Net()
    trainer_kw.setdefault("max_epochs", 1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(tmp_path), plugins=plugins,
        callbacks=[Moves(out), *callbacks], enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        strategy=HeteroDDPStrategy(start_method=START_METHOD, aggregation=aggregation, replan_every=None),
        **trainer_kw,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(devices)]


def _same_state(a, b):
    return all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["deadline", "pseudo_sync"])
def test_a_layer_unfrozen_during_the_fit_trains_alike_on_every_rank(tmp_path, mode):
    initial = Net(freeze=True).backbone.weight.detach().clone()
    r0, r1 = _fit(tmp_path, mode, max_epochs=2, callbacks=[Unfreeze()], model=Net(freeze=True))
    assert _same_state(r0, r1)  # the ranks diverged when each stepped the unfrozen layer on its own gradient
    assert not torch.equal(r0["state"]["backbone.weight"], initial)  # and it trained (it never did in deadline)


@pytest.mark.distributed
def test_local_sgd_ending_on_max_steps_inside_a_window_ends_on_one_model(tmp_path):
    r0, r1 = _fit(tmp_path, AggregationOptions("local_sgd", local_steps=4), max_steps=3, max_epochs=-1)
    assert r0["global_step"] == 3
    assert _same_state(r0, r1)


@pytest.mark.distributed
def test_pseudo_sync_final_flush_is_clipped_and_runs_on_before_optimizer_step(tmp_path):
    (r,) = _fit(tmp_path, AggregationOptions("pseudo_sync", min_confidence=1.0), devices=1,
                gradient_clip_val=0.01, gradient_clip_algorithm="norm", model=Net(samples=64))
    bound = 0.01 * 0.1 * (1 + 1e-6)  # clip value x learning rate
    assert max(r["moves"]) <= bound and 0 < r["flush_move"] <= bound  # the flush moved ~0.8 unclipped
    assert r["hook_calls"] == len(r["moves"])  # steps 1..3 apply steps 0..2, the flush applies step 3


@pytest.mark.distributed
def test_pseudo_sync_under_fp16_unscales_each_gradient_by_its_own_steps_loss_scale(tmp_path):
    def run(growth):
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=growth, growth_interval=1)
        (r,) = _fit(tmp_path, AggregationOptions("pseudo_sync", min_confidence=1.0), devices=1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                    model=Net(dtype=torch.float32))
        return r["state"]["head.weight"]

    initial = Net(dtype=torch.float32).head.weight.detach()
    constant, doubling = run(1.0001), run(2.0)  # growth_factor must exceed 1: 1.0001 is a near-constant scale
    moved = (constant - initial).norm().item()
    # each applied gradient was halved when the scale doubled between its step and the next (25% of the move)
    assert moved > 0.05 and (constant - doubling).norm().item() < 0.01 * moved


@pytest.mark.distributed
def test_pseudo_sync_resumed_from_an_epoch_end_checkpoint_equals_the_straight_run(tmp_path):
    opts = AggregationOptions("pseudo_sync", min_confidence=1.0)
    (straight,) = _fit(tmp_path / "a", opts, devices=1, max_epochs=2, model=Net(samples=64))
    ckpt_dir = str(tmp_path / "ckpt")
    _fit(tmp_path / "b", opts, devices=1, max_epochs=1, model=Net(samples=64),
         callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    (resumed,) = _fit(tmp_path / "c", opts, devices=1, max_epochs=2, model=Net(samples=64),
                      ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    for k, v in straight["state"].items():  # the gradient in flight at the checkpoint was applied after resume
        assert torch.allclose(v, resumed["state"][k], rtol=0, atol=1e-12), k
