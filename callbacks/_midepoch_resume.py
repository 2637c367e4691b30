"""A fit resumed from a mid-epoch checkpoint beside a stock strategy (``BatchBalancer`` with ``strategy="ddp"``).

Lightning restarts an unstateful train loader from its first batch but counts on from the step it stopped at,
so some samples would run twice and others not at all. Lightning prepares that loader through
``strategy.process_dataloader`` after the checkpoint's loop state is restored and before the first batch is
drawn: :func:`install_resume` wraps it once, and there :func:`resume_epoch` puts the checkpointed epoch's plan
back and has each rank skip its batches already trained on. The strategy is left as it was after the first
train loader, or at teardown (:func:`uninstall_resume`).

Lightning then warns that the loader "is not resumable" (it checks for a ``state_dict`` on the loader itself):
after an exact resume that warning is wrong, so :func:`resume_epoch` silences that one message until the
resumed epoch's first batch (:func:`end_quiet`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader

from hetero_plugins.callbacks._loaders import loader_plan

__all__ = ["NOT_RESUMABLE", "end_quiet", "install_resume", "resume_epoch", "uninstall_resume"]

#: The start of Lightning's warning about a mid-epoch resume of a loader without ``state_dict``.
NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def install_resume(balancer: Any, trainer: pl.Trainer, position: dict[str, Any] | None) -> None:
    """Wrap ``trainer.strategy.process_dataloader`` so the first train loader resumes ``position`` (the epoch,
    its plan and whether the plan ran, as ``BatchBalancer.state_dict`` saved them)."""
    strategy = trainer.strategy
    if position is None or getattr(strategy, "balancer", None) is not None:
        return  # nothing to resume, or a balanced strategy (its loader checkpoints its own position)
    original = strategy.process_dataloader
    ref = weakref.ref(balancer)

    def process_dataloader(dataloader: object) -> object:
        dataloader = original(dataloader)
        me = ref()
        if me is not None and trainer.state.stage == RunningStage.TRAINING:
            uninstall_resume(strategy)  # the first train loader only
            resume_epoch(me, dataloader, trainer, position)
        return dataloader

    process_dataloader._hetero_resume = True  # type: ignore[attr-defined]
    strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]


def uninstall_resume(strategy: Any) -> None:
    """Take the wrapper of :func:`install_resume` off ``strategy`` (if it is there)."""
    if getattr(strategy.__dict__.get("process_dataloader"), "_hetero_resume", False):
        del strategy.__dict__["process_dataloader"]


def resume_epoch(balancer: Any, dl: object, trainer: pl.Trainer, position: dict[str, Any]) -> None:
    """Skip this rank's batches of the checkpointed epoch that ran before the checkpoint; sets
    ``balancer._resumed_at`` to ``(steps skipped, plan installed)`` when it did."""
    done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    if position.get("epoch") != trainer.current_epoch or done <= 0 or not isinstance(dl, DataLoader):
        return
    try:
        steps = len(dl)
    except TypeError:
        return  # no length (an IterableDataset): the loader keeps its own batches
    limit = trainer.limit_train_batches
    if limit is not None:
        steps = min(steps, int(limit) if isinstance(limit, int) else int(steps * float(limit)))
    if done >= steps:
        return  # the epoch's training steps are all done
    applied = bool(position.get("applied")) and balancer.ensure_planner(trainer, dl) is not None
    found = loader_plan(dl, trainer.world_size)
    ran = list(balancer.planner.plan) if applied else found[0] if found else None
    if ran is None or ran != list(position.get("plan") or []):
        # resumed on another world size or batch: the saved epoch's order cannot be rebuilt
        balancer._warn_once("resume-plan", (
            "BatchBalancer: the mid-epoch checkpoint's epoch ran a plan this run cannot rebuild (another "
            "world size or batch size); the epoch's remaining steps run the loader's own batches, so some "
            "samples may run twice or not at all. HINT: resume a mid-epoch checkpoint with the same world "
            "size and batch size, or from an end-of-epoch checkpoint."))
        return
    if balancer.loaders.resume(dl, trainer, done, applied):
        balancer._resumed_at = (done, applied)
        end_quiet(balancer)
        quiet = warnings.catch_warnings()
        quiet.__enter__()
        warnings.filterwarnings("ignore", message=NOT_RESUMABLE, category=PossibleUserWarning)
        balancer._quiet_resume = quiet


def end_quiet(balancer: Any) -> None:
    """Lift the filter :func:`resume_epoch` set on Lightning's "not resumable" warning (nothing if none is set)."""
    quiet = balancer.__dict__.pop("_quiet_resume", None)
    if quiet is not None:
        quiet.__exit__(None, None, None)
