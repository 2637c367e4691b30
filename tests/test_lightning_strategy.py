"""Real multi-process Lightning runs (2 spawned gloo ranks on CPU) of HeteroDDPStrategy and BatchBalancer."""

from __future__ import annotations

import os

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

import hetero_plugins.strategies  # noqa: F401  (registers "hetero_ddp" / "hetero_ddp_spawn")
from hetero_plugins.callbacks import BatchBalancer, HeterogeneityEmulator, StragglerMonitor
from hetero_plugins.balancing.partition import epoch_layout, epoch_shards
from hetero_plugins.strategies import HeteroDDPStrategy
from hetero_plugins.apps.digits import digits_datasets
from tests.helpers.distributed import START_METHOD, rank_output
from tests.lightning_jobs import DigitsMLP, OwnWeights, Report, read_reports

pytestmark = pytest.mark.distributed


def forked(**kw) -> HeteroDDPStrategy:
    """The strategy with its ranks forked from the test session's fork server (tests/helpers/distributed.py)."""
    return HeteroDDPStrategy(start_method=START_METHOD, **kw)


def trainer(tmp_path, strategy, callbacks, **kw):
    opts = dict(accelerator="cpu", devices=2, max_epochs=3, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    opts.update(kw)
    return pl.Trainer(strategy=strategy, callbacks=callbacks + [Report(str(tmp_path))], default_root_dir=str(tmp_path), **opts)


def replay(model: DigitsMLP, history: list[dict], epochs: int, seed: int = 0) -> DigitsMLP:
    """One process stepping on each step's union of samples, plans taken from the run's history."""
    train, _ = digits_datasets(dtype=torch.float64)
    opt = model.configure_optimizers()
    n = len(train)
    for epoch in range(epochs):
        plan = history[epoch]["batch_sizes"]
        shards = epoch_shards(n, plan, epoch=epoch, seed=seed, shuffle=True, drop_last=False)
        layout = epoch_layout(n, plan)
        for k in range(layout.steps):
            idx = []
            for r, b in enumerate(plan):
                idx += shards[r][k * b : k * b + layout.step_counts(k)[r]].tolist()
            x, y = train[idx]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def test_registered_names_resolve():
    t = pl.Trainer(strategy="hetero_ddp_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, HeteroDDPStrategy)
    t = pl.Trainer(strategy="hetero_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, HeteroDDPStrategy)


def test_strategy_rebalances_and_equals_single_process_on_unions(tmp_path):
    pl.seed_everything(0)
    model = DigitsMLP(batch_size=16)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    t = trainer(tmp_path, forked(),
                [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002)], max_epochs=3)
    t.fit(model)
    reports = read_reports(str(tmp_path), 2)
    assert [rep["shared_weights"] for rep in reports] == [0, 0]  # each rank owns its weights (fork server)
    hist = reports[0]["plan_history"]
    # Every rank adopted the same plans; the slow rank's share dropped within the first epoch (mid-epoch
    # replanning every 5 steps), and the global batch stayed 32.
    assert reports[0]["plan_history"] == reports[1]["plan_history"]
    assert hist[0]["batch_sizes"] == [16, 16]
    first = hist[0]["plan_changes"][0]
    assert first["step"] <= 10 and first["batch_sizes"][1] < 10 and sum(first["batch_sizes"]) == 32
    assert hist[1]["batch_sizes"][1] < 10 and sum(hist[1]["batch_sizes"]) == 32
    assert hist[-1]["straggler_level"] < 0.3
    assert all(h["plan_applied"] for h in hist)
    assert reports[0]["hook_calls"] > 0
    # Each rank really ran the planned local batch of every step (plan changes included), and all ranks the
    # same number of steps.
    for e in range(3):
        plan_at = {0: hist[e]["batch_sizes"]}
        for change in hist[e]["plan_changes"]:
            plan_at[change["step"]] = change["batch_sizes"]
        for r, rep in enumerate(reports):
            sizes = rep["batches"][str(e)]
            current = None
            for k, b in enumerate(sizes[:-1]):
                current = plan_at.get(k, current)
                assert b == current[r], (e, k, r)
    assert len(reports[0]["batches"]["2"]) == len(reports[1]["batches"]["2"])
    # Exactness: the 2-rank run equals one process stepping on every step's union (float64, 1e-9).
    ref = DigitsMLP(batch_size=16)
    ref.load_state_dict(initial)
    replay(ref, hist, epochs=3, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(p, q, rtol=0, atol=1e-9), (name, (p - q).abs().max())
    # Validation ran with per-rank batch sizes, and its metric is the exact sample-weighted accuracy.
    _, val = digits_datasets(dtype=torch.float64)
    with torch.no_grad():
        acc = (ref(val.tensors[0]).argmax(1) == val.tensors[1]).double().mean().item()
    assert t.callback_metrics["val_acc"].item() == pytest.approx(acc, abs=1e-12)
    assert {rep["plan_history"][-1]["next_batch_sizes"][rep["rank"]] for rep in reports} != {16}
    # The same updates as stock DDP, end to end: stock "ddp" from the same weights and seed (equal batches of 16,
    # Lightning's DistributedSampler) ends on the same weights, float64 to 1e-9, though the run above split each
    # step's 32 samples unevenly and moved the split mid-epoch.
    assert any(h["plan_changes"] for h in hist)
    stock = DigitsMLP(batch_size=16)
    stock.load_state_dict(initial)
    (tmp_path / "stock").mkdir()
    trainer(tmp_path / "stock", DDPStrategy(start_method=START_METHOD), [OwnWeights()], max_epochs=3).fit(stock)
    stock_reports = read_reports(str(tmp_path / "stock"), 2)
    assert [rep["plan_history"] for rep in stock_reports] == [None, None]  # no balancer took part
    assert {b for rep in stock_reports for sizes in rep["batches"].values() for b in sizes[:-1]} == {16}
    assert any((p - initial[name]).abs().max() > 0.01 for name, p in model.state_dict().items())
    for (name, p), q in zip(model.state_dict().items(), stock_reports[0]["state"].values()):
        assert torch.allclose(p, torch.tensor(q, dtype=p.dtype), rtol=0, atol=1e-9), (name, (p - torch.tensor(q)).abs().max())
    # Validation inside fit follows each epoch's plan (Lightning prepares its loader once, under the equal plan).
    for e in (1, 2):
        shares = [rep["val_batches"][str(e)][0] for rep in reports]
        assert shares[1] < 16 < shares[0] and sum(shares) == 32, (e, shares)


def test_a_rank_waiting_for_its_batches_gets_fewer_samples(tmp_path):
    # Equal compute speeds (2 ms per sample), but rank 1's input pipeline makes it wait 30 ms for every batch:
    # a step ends when both have loaded and computed, so the shortest step gives rank 1 about 8 of 32 samples
    # (0.002 b0 = 0.03 + 0.002 b1). Split on compute time alone, it would keep 16.
    from tests.lightning_jobs import SlowInputDigitsMLP

    pl.seed_everything(0)
    t = trainer(tmp_path, forked(),
                [HeterogeneityEmulator([1.0, 1.0], cost_per_sample=0.002)], max_epochs=2, limit_train_batches=20)
    t.fit(SlowInputDigitsMLP(wait=0.03, batch_size=16))
    hist = read_reports(str(tmp_path), 2)[0]["plan_history"]
    assert hist[0]["batch_sizes"] == [16, 16]
    final = hist[-1]["next_batch_sizes"]
    assert sum(final) == 32 and final[1] <= 12, final


def test_callback_beside_stock_ddp(tmp_path):
    pl.seed_everything(0)
    balancer = BatchBalancer(allocator="lbb")
    # Stock DDP under the fork server: Lightning leaves the ranks' weights in one shared copy there, the balancer
    # gives each rank its own.
    t = trainer(tmp_path, DDPStrategy(start_method=START_METHOD),
                [balancer, HeterogeneityEmulator([0.25, 1.0], cost_per_sample=0.002)], max_epochs=3,
                limit_train_batches=20)
    t.fit(DigitsMLP(batch_size=16))
    reports = read_reports(str(tmp_path), 2)
    assert [rep["shared_weights"] for rep in reports] == [0, 0]
    hist = reports[0]["plan_history"]
    assert hist == reports[1]["plan_history"]
    assert hist[0]["batch_sizes"] == [16, 16]  # the first epoch runs on Lightning's own sampler
    assert [h["plan_applied"] for h in hist] == [False, True, True]
    assert hist[1]["batch_sizes"][0] < 10 and sum(hist[1]["batch_sizes"]) == 32  # rank 0 is the slow one here
    assert reports[0]["hook_calls"] > 0  # the callback registered its weighted hook on stock DDP
    assert set(reports[0]["batches"]["2"]) <= {hist[2]["batch_sizes"][0]} | {min(reports[0]["batches"]["2"])}
    assert len(reports[0]["batches"]["1"]) == 20  # limit_train_batches is honoured


def test_resume_keeps_plan_and_time_models(tmp_path):
    pl.seed_everything(0)
    ckpt_dir = tmp_path / "ckpt"
    first = tmp_path / "first"
    first.mkdir()
    emu = HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)
    t = trainer(first, forked(), [emu, ckpt], max_epochs=2, enable_checkpointing=True,
                limit_train_batches=15, limit_val_batches=2)
    t.fit(DigitsMLP(batch_size=16))
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["callbacks"]["BatchBalancer"]["planner"]
    assert len(saved["history"]) == 2 and all(len(m["observations"]) > 0 for m in saved["models"])
    second = tmp_path / "second"
    second.mkdir()
    t2 = trainer(second, forked(), [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002)],
                 max_epochs=3, limit_train_batches=15, limit_val_batches=2)
    t2.fit(DigitsMLP(batch_size=16), ckpt_path=str(ckpt_dir / "last.ckpt"))
    hist = read_reports(str(second), 2)[0]["plan_history"]
    assert len(hist) == 3 and hist[:2] == saved["history"]
    assert hist[2]["batch_sizes"] == saved["plan"]  # the resumed epoch starts on the saved plan


def test_weighted_random_sampler_reports_no_plan_applied(tmp_path):
    from tests.balancer_jobs import StepLogMLP

    pl.seed_everything(0)
    t = trainer(tmp_path, forked(), [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002)], max_epochs=2,
                limit_val_batches=0)
    with rank_output() as ranks:
        t.fit(StepLogMLP(str(tmp_path), loader="weighted", batch_size=16))
    assert ranks.text.count("cannot rebalance DistributedSamplerWrapper") == 1
    reports = read_reports(str(tmp_path), 2)
    hist = reports[0]["plan_history"]
    assert len(hist) == 2 and hist == reports[1]["plan_history"]
    for entry in hist:  # the plan that ran: the loader's equal batches, and no other one announced
        assert entry["plan_applied"] is False and entry["plan_changed"] is False
        assert entry["batch_sizes"] == entry["next_batch_sizes"] == [16, 16]
    assert hist[1]["throughput"][0] > 2 * hist[1]["throughput"][1]  # rank 1 is slow, yet nothing can be moved
    assert reports[0]["batch_plan"] == reports[0]["strategy_plan"] == [16, 16]
    assert all(set(rep["batches"][e]) == {16} for rep in reports for e in ("0", "1"))
    assert t.callback_metrics["hetero/plan_applied"].item() == 0.0
    assert t.callback_metrics["hetero/batch_size/rank_0"].item() == 16.0


def test_gradient_accumulation_mixed_precision_and_batchnorm_warning(tmp_path):
    from hetero_plugins.apps.digits import DigitsCNN

    pl.seed_everything(0)
    t = trainer(tmp_path, forked(min_batch_size=2),
                [HeterogeneityEmulator([1.0, 0.5], cost_per_sample=0.002)],
                max_epochs=2, accumulate_grad_batches=2, limit_train_batches=10, precision="bf16-mixed")
    with pytest.warns(RuntimeWarning, match="BatchNorm"):
        BatchBalancer().setup(t, DigitsMLP(batchnorm=True), "fit")
    t.fit(DigitsCNN(batch_size=16))
    hist = read_reports(str(tmp_path), 2)[0]["plan_history"]
    assert len(hist) == 2 and all(sum(h["batch_sizes"]) == 32 and min(h["batch_sizes"]) >= 2 for h in hist)


def test_failing_rank_ends_the_run_with_its_error(tmp_path):
    t = trainer(tmp_path, forked(), [], max_epochs=3, limit_train_batches=6)
    with pytest.raises(Exception, match="injected failure on rank 1"):
        t.fit(DigitsMLP(batch_size=16, fail_on_rank=1))


def test_dying_rank_ends_the_run_instead_of_hanging(tmp_path):
    import time

    t = trainer(tmp_path, forked(), [], max_epochs=3, limit_train_batches=6)
    start = time.monotonic()
    with pytest.raises(Exception, match="exit code 13|exited with exit code 13|process 1"):
        t.fit(DigitsMLP(batch_size=16, fail_on_rank=1, die=True))
    assert time.monotonic() - start < 120


def test_dataset_smaller_than_global_batch(tmp_path):
    t = trainer(tmp_path, forked(), [], max_epochs=1)
    with pytest.raises(Exception, match="fewer than one global batch"):
        t.fit(DigitsMLP(batch_size=1000))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_batch_size=0), "min_batch_size"),
        (dict(allocator="fast"), "allocator"),
        (dict(min_gain=-0.1), "min_gain"),
        (dict(max_batch_size=2, min_batch_size=4), "max_batch_size"),
        (dict(timeout=5), "timeout"),
        (dict(ddp_comm_hook=lambda s, b: None), "ddp_comm_hook"),
    ],
)
def test_bad_strategy_arguments_fail_before_any_process_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeteroDDPStrategy(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(allocater="lbb"), "unexpected keyword argument 'allocater'. HINT: did you mean 'allocator'"),
        (dict(find_unused_parameter=True), "'find_unused_parameter'. HINT: did you mean 'find_unused_parameters'"),
        (dict(min_batchsize=4), "'min_batchsize'. HINT: did you mean 'min_batch_size'"),
        (dict(device_ids=[0]), "unexpected keyword argument 'device_ids'"),
    ],
)
def test_mistyped_strategy_keyword_is_named_at_construction(kwargs, match):
    with pytest.raises(TypeError, match=match):
        HeteroDDPStrategy(**kwargs)
    # What DDPStrategy and DistributedDataParallel take still passes through.
    s = HeteroDDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=True, start_method="spawn")
    assert s._ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}


def test_emulator_needs_one_speed_per_rank(tmp_path):
    t = trainer(tmp_path, forked(), [HeterogeneityEmulator([1.0, 1.0, 1.0], 0.001)], max_epochs=1)
    with pytest.raises(Exception, match="3 `speeds`"):
        t.fit(DigitsMLP())


@pytest.mark.parametrize("strategy, callbacks, who", [
    ("ddp", lambda: [BatchBalancer(), StragglerMonitor()], "BatchBalancer and StragglerMonitor"),
    ("hetero_ddp", lambda: [StragglerMonitor()], "BatchBalancer and StragglerMonitor"),
    ("hetero_ddp", lambda: [BatchBalancer(allocator="lbb")], "2 BatchBalancer callbacks"),  # the strategy's and ours
])
def test_two_gradient_weightings_are_refused_before_the_first_step(tmp_path, strategy, callbacks, who):
    """Each of these registers the weighted comm hook and torch takes one per model: the run stops at setup with
    the fix, not with torch's "register_comm_hook ... can only be called once" in every rank."""
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks(), max_epochs=1,
                   limit_train_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=rf"^{who} each weight the gradients with a DDP comm hook.*HINT: keep one"):
        t.fit(DigitsMLP(batch_size=16))


def test_one_rank_beside_the_default_strategy_runs_without_a_rebalancing_warning(tmp_path):
    """World size 1: Lightning keeps a plain sampler, and there is nothing to rebalance, so nothing to warn about
    (it used to suggest use_distributed_sampler=True, which was already set)."""
    import warnings

    balancer = BatchBalancer()
    t = pl.Trainer(accelerator="cpu", devices=1, callbacks=[balancer], max_epochs=1, limit_train_batches=2,
                   limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(DigitsMLP(batch_size=16))
    assert not [w for w in caught if "cannot rebalance" in str(w.message)]
    assert [e["batch_sizes"] for e in balancer.plan_history] == [[16]]


class _TwoLoaders(DigitsMLP):
    def train_dataloader(self):
        from torch.utils.data import DataLoader

        data = digits_datasets(dtype=torch.float64)[0]
        return [DataLoader(data, batch_size=4), DataLoader(data, batch_size=8)]

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)


@pytest.mark.parametrize("strategy, callbacks", [("hetero_ddp", lambda: []), ("ddp", lambda: [BatchBalancer()])])
def test_several_train_loaders_are_refused_before_the_first_step(tmp_path, strategy, callbacks):
    # Each loader used to get the first one's plan (the second ran 4 samples, not 8), then the epoch end failed.
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks(), max_epochs=1,
                   limit_train_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"BatchBalancer balances one train DataLoader; this fit has 2.*HINT"):
        t.fit(_TwoLoaders(batch_size=16))


def test_a_train_loader_subclass_is_named_when_it_is_rebuilt(tmp_path):
    from torch.utils.data import DataLoader

    class TaggingLoader(DataLoader):
        pass

    class Module(DigitsMLP):
        def train_dataloader(self):
            return TaggingLoader(digits_datasets(dtype=torch.float64)[0], batch_size=16, shuffle=True)

    t = pl.Trainer(accelerator="cpu", devices=1, strategy="hetero_ddp", max_epochs=1, limit_train_batches=2,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="the train loader is a TaggingLoader.*HINT: move that logic"):
        t.fit(Module(batch_size=16))
