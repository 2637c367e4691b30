"""Learning rate when the global batch changes: rules, ramp, momentum compensation, schedulers, checkpoints,
the Lightning callback (in-process and a real 2-process run resumed on 1 process) and the Horovod reset hook."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.callbacks import LRAdapter
from hetero_plugins.horovod.lr import elastic_lr_callback, register_elastic_handler
from hetero_plugins.lr_scaling import LRScaler, adascale_gain, gradient_noise_stats
from tests.lightning_jobs import DigitsMLP


def sgd(lr: float = 0.1, momentum: float = 0.9, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2).double()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    model.zero_grad()
    (model(x) ** 2).sum().backward()


# ----------------------------------------------------------------------------------------------- rules
@pytest.mark.parametrize(
    ("rule", "new", "expected"),
    [("linear", 128, 2.0), ("linear", 16, 0.25), ("sqrt", 256, 2.0), ("sqrt", 16, 0.5), ("none", 256, 1.0)],
)
def test_rule_targets(rule, new, expected):
    s = LRScaler(rule=rule, ramp_steps=0, reference_batch=64)
    assert s.on_global_batch_change(new, step=0) == pytest.approx(expected)
    assert s.factor(0) == pytest.approx(expected) and s.global_batch == new


def test_adascale_gain_and_stats():
    assert adascale_gain(3.0, 1.0, 4.0) == pytest.approx(4.0 / 1.75)
    assert adascale_gain(0.0, 2.0, 8.0) == 1.0  # no noise: a bigger batch does not help
    assert adascale_gain(2.0, 0.0, 8.0) == pytest.approx(8.0)  # pure noise: the linear rule
    assert 0.5 < adascale_gain(1.0, 1.0, 0.5) < 1.0  # a smaller batch: between scale and 1
    sigma2, mu2 = gradient_noise_stats(1.5, 1.125, local_batch=8, global_batch=32, reference_batch=32)
    assert (sigma2, mu2) == pytest.approx((0.125, 1.0))
    # adascale rule: from observed statistics, or from an explicit gain.
    s = LRScaler(rule="adascale", ramp_steps=0, reference_batch=32)
    s.observe_gradient_stats(sigma2, mu2)
    assert s.on_global_batch_change(128, step=0) == pytest.approx(adascale_gain(0.125, 1.0, 4.0))
    assert s.on_global_batch_change(64, step=1, gain=1.5) == 1.5


def test_first_batch_becomes_reference_and_same_batch_changes_nothing():
    s = LRScaler(ramp_steps=4)
    assert s.reference_batch is None
    assert s.on_global_batch_change(48, step=3) == 1.0 and s.reference_batch == 48 and s.factor(3) == 1.0
    assert s.on_global_batch_change(96, step=5) == 2.0
    assert s.on_global_batch_change(96, step=7) == 2.0 and s.factor(6) == pytest.approx(1.5)  # ramp kept


# ----------------------------------------------------------------------------------------------- ramp
def test_ramp_values_at_each_step():
    s = LRScaler(rule="linear", ramp_steps=4, reference_batch=64)
    s.on_global_batch_change(32, step=10)
    assert [s.factor(t) for t in range(8, 16)] == pytest.approx([1, 1, 0.875, 0.75, 0.625, 0.5, 0.5, 0.5])
    # A change in the middle of a ramp continues from the factor of the step before it.
    s.on_global_batch_change(128, step=12)
    assert [s.factor(t) for t in range(11, 17)] == pytest.approx([0.75, 0.75 + 1.25 / 4, 0.75 + 1.25 / 2,
                                                                  0.75 + 1.25 * 3 / 4, 2.0, 2.0])
    # ramp_steps=0: at once; the applied learning rate follows the factor.
    model, opt = sgd(lr=0.2)
    s0 = LRScaler(rule="sqrt", ramp_steps=0, reference_batch=16)
    s0.on_global_batch_change(64, step=5)
    assert s0.apply(opt, 4) == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert s0.apply(opt, 5) == 2.0 and opt.param_groups[0]["lr"] == pytest.approx(0.4)
    assert s0.apply(opt, 5) == 2.0 and opt.param_groups[0]["lr"] == pytest.approx(0.4)  # idempotent per step


def test_pending_change_starts_at_next_apply():
    _, opt = sgd(lr=1.0)
    s = LRScaler(rule="linear", ramp_steps=2, reference_batch=10)
    s.apply(opt, 6)
    s.on_global_batch_change(30, step=None)
    assert s.factor(7) == 1.0 and s.target_factor == 3.0
    assert [s.apply(opt, t) for t in (7, 8, 9)] == pytest.approx([2.0, 3.0, 3.0])


# ------------------------------------------------------------------------------------ momentum compensation
@pytest.mark.parametrize("compensate", [True, False])
@pytest.mark.parametrize("ramp_steps", [0, 4])
def test_momentum_compensation_first_update_after_change(compensate, ramp_steps):
    lr, mu = 0.05, 0.9
    model, opt = sgd(lr=lr, momentum=mu)
    s = LRScaler(rule="linear", ramp_steps=ramp_steps, momentum_compensation=compensate, reference_batch=32)
    for t in range(3):  # history at factor 1
        backward(model, t)
        with s.scaled(opt, t):
            opt.step()
    s.on_global_batch_change(128, step=3)  # x4
    backward(model, 3)
    p = model.weight
    v, g, before = opt.state[p]["momentum_buffer"].clone(), p.grad.clone(), p.detach().clone()
    with s.scaled(opt, 3) as f:
        opt.step()
    assert f == pytest.approx(4.0 if ramp_steps == 0 else 1.0 + 3.0 / 4)
    if compensate:  # the history keeps the update size it had at the old factor (1); the new gradient gets f
        expected = before - lr * (mu * 1.0 * v + f * g)
    else:  # torch's own semantics: the whole momentum is multiplied by the new factor
        expected = before - lr * f * (mu * v + g)
    assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-12)
    assert opt.param_groups[0]["lr"] == lr  # restored after the step
    # Next ramp step: again only the factor change of this step is compensated (f_prev / f).
    if ramp_steps and compensate:
        backward(model, 4)
        v, g, before = opt.state[p]["momentum_buffer"].clone(), p.grad.clone(), p.detach().clone()
        with s.scaled(opt, 4) as f2:
            opt.step()
        assert torch.allclose(p.detach(), before - lr * (mu * f * v + f2 * g), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------ torch schedulers
def test_composes_with_chainable_and_closed_form_schedulers():
    base_lr = 0.1
    s = LRScaler(rule="linear", ramp_steps=2, reference_batch=8)
    s.on_global_batch_change(16, step=3)
    for make in (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
                 lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t))):
        model, opt = sgd(lr=base_lr)
        ref_model, ref_opt = sgd(lr=base_lr)
        sched, ref_sched = make(opt), make(ref_opt)
        handle = s.restore_after_step(opt)
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
        for t in range(7):
            backward(model, t)
            s.apply(opt, t)  # the hook restores after the step, before sched.step()
            opt.step()
            sched.step()
            ref_opt.step()
            ref_sched.step()
            assert sched.get_last_lr() == pytest.approx(ref_sched.get_last_lr())  # the schedule is untouched
        handle.remove()
        schedule = [base_lr * 0.9**t for t in range(7)] if isinstance(sched, torch.optim.lr_scheduler.ExponentialLR) \
            else [base_lr / (1 + t) for t in range(7)]
        assert seen == pytest.approx([schedule[t] * s.factor(t) for t in range(7)])
        assert [s.factor(t) for t in range(7)] == pytest.approx([1, 1, 1, 1.5, 2, 2, 2])
    # A closed-form scheduler also composes with apply() alone (it writes a fresh value every step).
    model, opt = sgd(lr=base_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    for t in range(6):
        assert s.apply(opt, t) * base_lr / (1 + t) == pytest.approx(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()


def test_tensor_learning_rate_and_several_groups():
    w1, w2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [w1], "lr": torch.tensor(0.5)}, {"params": [w2], "lr": 0.01}], lr=0.1)
    s = LRScaler(rule="linear", ramp_steps=0, reference_batch=4)
    s.on_global_batch_change(8, step=0)
    s.apply(opt, 0)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and float(opt.param_groups[0]["lr"]) == 1.0
    assert opt.param_groups[1]["lr"] == 0.02
    s.restore(opt)
    assert float(opt.param_groups[0]["lr"]) == 0.5 and opt.param_groups[1]["lr"] == 0.01


# ------------------------------------------------------------------------------------ checkpoints
def test_state_round_trip_mid_ramp_and_pending():
    s = LRScaler(rule="sqrt", ramp_steps=5, reference_batch=16)
    s.observe_gradient_stats(0.5, 0.25)
    s.on_global_batch_change(64, step=20)
    _, opt = sgd()
    s.apply(opt, 22)
    state = json.loads(json.dumps(s.state_dict()))  # plain data
    t = LRScaler(rule="sqrt", ramp_steps=5)
    t.load_state_dict(state)
    assert [t.factor(k) for k in range(18, 28)] == [s.factor(k) for k in range(18, 28)]
    assert (t.reference_batch, t.global_batch, t.last_step, t.gradient_stats) == (16, 64, 22, (0.5, 0.25))
    s.on_global_batch_change(16, step=None)
    u = LRScaler(rule="sqrt", ramp_steps=5)
    u.load_state_dict(s.state_dict())
    assert u.target_factor == 1.0 and u.apply(opt, 30) == s.apply(opt, 30)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rule="cubic"), r"`rule` must be one of .*'cubic'.*HINT"),
        (dict(ramp_steps=-1), r"`ramp_steps` must be >= 0, got -1.*HINT"),
        (dict(ramp_steps=2.5), r"`ramp_steps` must be an int, got 2.5"),
        (dict(momentum_compensation="yes"), r"`momentum_compensation` must be a bool, got 'yes'.*HINT"),
        (dict(reference_batch=0), r"`reference_batch` must be >= 1, got 0.*HINT"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRScaler(**kwargs)
    with pytest.raises(ValueError, match=match):
        LRAdapter(**kwargs)


def test_bad_calls():
    s = LRScaler(rule="linear", reference_batch=8)
    with pytest.raises(ValueError, match=r"`new_global_batch` must be >= 1, got 0"):
        s.on_global_batch_change(0, step=1)
    with pytest.raises(ValueError, match=r"`step` must be >= 0, got -3"):
        s.on_global_batch_change(16, step=-3)
    with pytest.raises(ValueError, match=r"`gain`=2.0 is only used by rule='adascale'.*HINT"):
        s.on_global_batch_change(16, step=1, gain=2.0)
    with pytest.raises(ValueError, match=r"needs gradient statistics.*HINT"):
        LRScaler(rule="adascale", reference_batch=8).on_global_batch_change(16, step=1)
    with pytest.raises(ValueError, match=r"`reference_batch` is not set.*HINT"):
        LRScaler().rule_factor(8)
    with pytest.raises(ValueError, match=r"`sigma2` must be >= 0.0, got -1.0"):
        adascale_gain(-1.0, 1.0, 2.0)
    with pytest.raises(ValueError, match=r"`scale` must be > 0.0, got 0.0"):
        adascale_gain(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"`sigma2` \+ `mu2` must be > 0"):
        adascale_gain(0.0, 0.0, 2.0)
    with pytest.raises(ValueError, match=r"`state` is not an LRScaler.state_dict\(\).*HINT"):
        s.load_state_dict({"rule": "linear"})
    bad = {**s.state_dict(), "start_factor": "fast"}  # a field that is not a number: named, not a bare float() error
    with pytest.raises(ValueError, match=r"`state` is not an LRScaler.state_dict\(\).*could not convert.*HINT"):
        s.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"`gradient_stats` is only used by rule='adascale'"):
        LRAdapter(gradient_stats=lambda t, m: (1.0, 1.0))
    with pytest.raises(ValueError, match=r"`gradient_stats` must be a callable"):
        LRAdapter(rule="adascale", gradient_stats=3)
    with pytest.raises(ValueError, match=r"`scaler` must be an LRScaler"):
        elastic_lr_callback(object(), None, lambda: 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`global_batch_fn` must be a callable"):
        elastic_lr_callback(s, None, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`global_batch_fn\(\)` must be >= 1, got 0"):
        elastic_lr_callback(s, None, lambda: 0)()


# ------------------------------------------------------------------------------------ Horovod reset hook
def test_elastic_reset_callback_logic():
    world = {"size": 4, "step": 0}
    _, opt = sgd(lr=0.1)
    s = LRScaler(rule="linear", ramp_steps=2, reference_batch=32 * 4)
    on_reset = elastic_lr_callback(s, opt, lambda: 32 * world["size"])
    on_reset()  # same world: nothing changes
    assert s.global_batch == 128 and s.target_factor == 1.0
    s.apply(opt, 5)
    world["size"] = 2
    on_reset()
    assert s.global_batch == 64 and s.target_factor == 0.5
    assert s.factor(6) == 1.0  # pending until the next apply, whatever step the synced state resumes at
    assert [s.apply(opt, t) for t in (9, 10)] == pytest.approx([0.75, 0.5])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # a step interrupted before restore() ...
    world["size"] = 4
    on_reset()
    assert opt.param_groups[0]["lr"] == 0.1  # ... is undone at the reset
    assert [s.apply(opt, t) for t in (11, 12)] == pytest.approx([0.75, 1.0])
    # With a step function the ramp starts at that step; a fresh scaler adopts the first batch as reference.
    s2 = LRScaler(rule="sqrt", ramp_steps=0)
    on_reset2 = elastic_lr_callback(s2, None, lambda: 32 * world["size"], step_fn=lambda: world["step"])
    on_reset2()
    assert s2.reference_batch == 128
    world.update(size=16, step=40)
    on_reset2()
    assert s2.factor(39) == 1.0 and s2.factor(40) == 2.0


def test_elastic_state_handler_commit_restore():
    pytest.importorskip("horovod.torch")
    from horovod.torch.elastic import state as elastic_state

    assert register_elastic_handler() and register_elastic_handler()  # idempotent
    handler_cls = dict(elastic_state.get_handler_registry())[LRScaler]
    s = LRScaler(rule="linear", ramp_steps=4, reference_batch=64)
    handler = handler_cls(s)  # what TorchState(lr_scaler=s) builds; commit = save, failure = restore
    s.on_global_batch_change(32, step=3)
    handler.save()
    s.on_global_batch_change(128, step=9)
    handler.restore()
    assert s.global_batch == 32 and s.factor(6) == 0.5


# ------------------------------------------------------------------------------------ Lightning
class LRRecorder(Callback):
    """The learning rate each optimizer step really uses (read just before the step)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.seen.append((trainer.global_step, optimizer.param_groups[0]["lr"]))


class GrowingBatchMLP(DigitsMLP):
    """The user doubles the per-rank batch after the first epoch; an ExponentialLR steps every step."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        bs = self.hparams.batch_size * (2 if self.current_epoch >= 1 else 1)
        return DataLoader(digits_datasets(dtype=torch.float64)[0], batch_size=bs, shuffle=True)


def local_trainer(tmp_path, callbacks, **kw) -> pl.Trainer:
    opts = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    opts.update(kw)
    return pl.Trainer(callbacks=callbacks, default_root_dir=str(tmp_path), **opts)


def test_callback_follows_a_batch_change_between_epochs_and_composes_with_scheduler(tmp_path):
    adapter, rec = LRAdapter(rule="linear", ramp_steps=3), LRRecorder()
    t = local_trainer(tmp_path, [adapter, rec], max_epochs=2, limit_train_batches=5,
                      reload_dataloaders_every_n_epochs=1)
    t.fit(GrowingBatchMLP(batch_size=8, lr=0.1))
    assert adapter.scaler.reference_batch == 8 and adapter.scaler.global_batch == 16
    assert adapter.changes == [{"step": 5, "old": 8, "new": 16, "target_factor": 2.0}]
    factors = [1.0] * 5 + [1 + 1 / 3, 1 + 2 / 3, 2.0, 2.0, 2.0]
    assert [s for s, _ in rec.seen] == list(range(10))
    assert [lr for _, lr in rec.seen] == pytest.approx([0.1 * 0.95**k * f for k, f in enumerate(factors)])
    # The scheduler never saw the factor; the optimizer holds the schedule's value after training.
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.95**10)
    assert t.callback_metrics["hetero/lr_scale"].item() == pytest.approx(2.0)


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_on_fewer_processes_ramps_to_the_new_learning_rate(tmp_path):
    """Train 1 epoch on 2 spawned gloo ranks (global batch 32), resume on 1 process (global batch 16)."""
    pl.seed_everything(0)
    ckpt_dir = tmp_path / "ckpt"
    first = pl.Trainer(
        strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=6,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[LRAdapter(rule="linear", ramp_steps=4),
                   pl.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)],
    )
    first.fit(DigitsMLP(batch_size=16, lr=0.1))
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert saved["callbacks"]["LRAdapter"]["scaler"]["reference_batch"] == 32
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1  # the schedule's value, not scaled
    adapter, rec = LRAdapter(rule="linear", ramp_steps=4), LRRecorder()
    second = local_trainer(tmp_path / "second", [adapter, rec], max_epochs=2, limit_train_batches=6)
    second.fit(DigitsMLP(batch_size=16, lr=0.1), ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert adapter.changes == [{"step": 6, "old": 32, "new": 16, "target_factor": 0.5}]
    assert [s for s, _ in rec.seen] == list(range(6, 12))
    assert [lr for _, lr in rec.seen] == pytest.approx([0.0875, 0.075, 0.0625, 0.05, 0.05, 0.05])
    assert math.isclose(adapter.scaler.factor(100), 0.5)
