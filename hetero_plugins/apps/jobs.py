"""Run the digits CNN on N emulated CPU ranks under stock DDP or HeteroDDPStrategy (used by demo and bench)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_digits_job", "steady_mean"]


def run_digits_job(
    mode: str,
    speeds: Sequence[float],
    cost_per_sample: float,
    epochs: int,
    schedule: Mapping[int, Any] | None = None,
    batch_size: int = 32,
    seed: int = 0,
    label: str | None = None,
    allocator: str = "equal_finish",
    out_dir: str | os.PathLike | None = None,
    stalls: Any = None,
    replan_every: int | None = 5,
    aggregation: Any = None,
    momentum: float = 0.9,
    run_dir: str | os.PathLike | None = None,
    dtype: str = "float32",
    keep_weights: bool = False,
) -> dict[str, Any]:
    """Train the digits CNN on ``len(speeds)`` spawned CPU ranks; return rank 0's record.

    Args:
        mode: ``"ddp"`` (stock DDP, equal batches, measured by a StragglerMonitor) or ``"hetero"``.
        speeds, cost_per_sample, schedule: the emulated cluster (see ``HeterogeneityEmulator``).
        epochs: training epochs; batch_size: per-rank batch at the start (global = batch_size x ranks).
        label: progress-line prefix (``None``: quiet).
        stalls: transient stalls for the emulator (``Stall`` entries or a ``RandomStalls``).
        replan_every: the strategy's mid-epoch replanning interval (``None``: epoch ends only).
        aggregation: the strategy's ``aggregation=`` (``None``: ``"weighted"``).
        momentum: SGD momentum of the CNN.
        run_dir: keep what a user's run leaves behind there: Lightning's ``CSVLogger`` log (the ``hetero/*``
            metrics) and its default checkpoint (the balancer's state), under ``lightning_logs/version_N``;
            ``hetero-plugins report run_dir`` draws them. ``None``: no log, no checkpoint.
        dtype: the CNN's and the data's float type (``"float32"`` or ``"float64"``).
        keep_weights: also return rank 0's final weights, as ``record["state_dict"]``.

    Returns:
        ``{"epochs": [...], "plan_history": [...]}``: per-epoch train time, wall time, val accuracy and loss,
        batch sizes and straggler level.
    """
    import lightning.pytorch as pl

    import hetero_plugins.strategies  # noqa: F401  (registers the strategy names)
    from hetero_plugins.apps.digits import DigitsCNN, RunRecorder
    from hetero_plugins.callbacks import HeterogeneityEmulator, StragglerMonitor

    if mode not in ("ddp", "hetero"):
        raise ValueError(f"`mode` must be 'ddp' or 'hetero', got {mode!r}.")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the spawned ranks read it at start-up
    pl.seed_everything(seed, verbose=False)
    tmp = tempfile.mkdtemp(prefix="hetero-job-", dir=out_dir)
    record = Path(tmp) / "record.json"
    callbacks: list[Any] = [
        HeterogeneityEmulator(speeds, cost_per_sample=cost_per_sample, schedule=schedule, stalls=stalls),
        RunRecorder(record, label=label, weights=Path(tmp) / "weights.pt" if keep_weights else None),
    ]
    if mode == "ddp":
        callbacks.append(StragglerMonitor())
        strategy: Any = "ddp_spawn"
    else:
        from hetero_plugins.strategies import HeteroDDPStrategy

        strategy = HeteroDDPStrategy(start_method="spawn", allocator=allocator, replan_every=replan_every,
                                     aggregation=aggregation)
    logger: Any = False
    if run_dir is not None:
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(run_dir)
    trainer = pl.Trainer(
        accelerator="cpu", devices=len(speeds), strategy=strategy, max_epochs=epochs, logger=logger,
        enable_checkpointing=run_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=tmp if run_dir is None else os.fspath(run_dir),
    )
    trainer.fit(DigitsCNN(batch_size=batch_size, seed=seed, momentum=momentum, dtype=dtype))
    result = json.loads(record.read_text())
    if keep_weights:
        import torch

        result["state_dict"] = torch.load(Path(tmp) / "weights.pt", weights_only=True)
    return result


def steady_mean(record: Mapping[str, Any], skip: int = 2, key: str = "train_time", until: int | None = None) -> float:
    """Mean of ``key`` over epochs ``skip``..``until`` (the first epochs hold start-up and the first plan)."""
    values = [e[key] for e in record["epochs"][skip:until]]
    if not values:
        raise ValueError(f"no epochs after skipping {skip}: the run has {len(record['epochs'])} epochs")
    return float(sum(values) / len(values))
