"""Per-rank batch sizes inside the loaders Lightning prepares, and predictions put back in dataset order.

Only public attributes of torch's samplers are touched: the ``sampler`` and ``batch_size`` of a
``BatchSampler`` that wraps the ``DistributedSampler`` Lightning injected. A train loader is rebuilt around a
:class:`~hetero_plugins.balancing.sampler.HeteroBatchSampler` (batches drawn step by step, so plans can change
mid-epoch); evaluation loaders get a :class:`~hetero_plugins.balancing.sampler.HeteroDistributedSampler`; the
predict loader gets contiguous per-rank slices of the prediction order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn

from hetero_plugins.balancing.allocators import Bounds, largest_remainder
from hetero_plugins.balancing.partition import contiguous_split
from hetero_plugins.balancing.sampler import HeteroBatchSampler, HeteroDistributedSampler, HeteroInferenceBatchSampler

__all__ = ["UNSIZED", "BalancedLoaders", "ResumedSampler", "ResumableLoader", "can_balance", "loader_like", "loader_plan"]

#: The one warning for a dataset without a length (an ``IterableDataset``).
UNSIZED = ("BatchBalancer: the dataset has no len() (an IterableDataset): per-rank batch sizes need a sized "
           "dataset, so every rank keeps the loader's own batches, as stock DDP does, and no plan is applied "
           "(plan_history says plan_applied=False). HINT: use a map-style Dataset (__len__ and __getitem__) to "
           "balance batch sizes.")


class ResumedSampler(Sampler[int]):
    """``sampler``'s indices from position ``skip`` on: a resumed epoch's remaining share of this rank (beside a
    stock strategy, whose train loader Lightning does not checkpoint). ``len`` stays ``sampler``'s, as Lightning
    counts the resumed epoch's steps from the step it restarts at. Put back by :meth:`BalancedLoaders.install`."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = int(skip)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _inner(bs: object) -> Any:
    """The sampler inside batch sampler ``bs`` (the one a :class:`ResumedSampler` wraps)."""
    inner = getattr(bs, "sampler", None)
    return inner.sampler if isinstance(inner, ResumedSampler) else inner


def loader_plan(dl: object, world: int) -> tuple[list[int], int | None] | None:
    """The first plan and the dataset length a train loader implies (``None``: not a batched ``DataLoader``).

    A balanced sampler brings its plan; Lightning's ``DistributedSampler`` in a ``BatchSampler`` means the
    loader's ``batch_size`` on every rank. The length is ``None`` for a dataset without one.
    """
    if not isinstance(dl, DataLoader) or dl.batch_sampler is None:
        return None
    bs = dl.batch_sampler
    if isinstance(bs, HeteroBatchSampler):
        return list(bs.plan), bs.sampler.num_samples
    inner = _inner(bs)
    if isinstance(inner, HeteroDistributedSampler):
        return list(inner.plan), inner.num_samples
    local = getattr(bs, "batch_size", None)
    if not isinstance(local, int):
        return None
    return [local] * world, sized_len(inner.dataset if isinstance(inner, DistributedSampler) else dl.dataset)


def can_balance(dl: object) -> bool:
    """Whether per-rank batch sizes can be installed in train loader ``dl`` (see :meth:`BalancedLoaders.install`)."""
    if not isinstance(dl, DataLoader) or sized_len(dl.dataset) is None:
        return False
    bs = dl.batch_sampler
    if isinstance(bs, HeteroBatchSampler):
        return True
    inner = _inner(bs)
    return type(bs) is BatchSampler and (isinstance(inner, HeteroDistributedSampler) or type(inner) is DistributedSampler)


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`HeteroBatchSampler` that Lightning checkpoints and resumes mid-epoch.

    Lightning saves the ``state_dict`` of a train loader that has one in the fit loop's checkpoint state and
    loads it before the resumed epoch's first batch (as for torchdata's ``StatefulDataLoader``). The state is
    the batch sampler's, with the steps this loader has delivered (not those its workers drew ahead), so the
    resumed epoch starts at the first step that was not trained on.
    """

    #: ``(epoch, steps delivered)`` of the latest iteration (``None`` before the first).
    position: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        bs: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        epoch, done = bs.epoch, bs.start_step
        self.position = (epoch, done)
        for batch in super().__iter__():
            done += 1
            self.position = (epoch, done)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        bs: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        at = self.position
        return bs.state_dict(steps_done=at[1] if at is not None and at[0] == bs.epoch else bs.start_step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)  # type: ignore[union-attr]


def loader_like(dl: DataLoader, batch_sampler: Any, resumable: bool = False) -> DataLoader:
    """A ``DataLoader`` over ``dl``'s dataset with ``dl``'s loading options and another batch sampler
    (a :class:`ResumableLoader` with ``resumable``)."""
    return (ResumableLoader if resumable else DataLoader)(
        dl.dataset,
        batch_sampler=batch_sampler,
        num_workers=dl.num_workers,
        collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory,
        timeout=dl.timeout,
        worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context,
        prefetch_factor=dl.prefetch_factor,
        persistent_workers=dl.persistent_workers,
        generator=dl.generator,
    )

class _Balancer(Protocol):
    """What the loaders need from their ``BatchBalancer``."""

    options: Any
    planner: Any

    def ensure_planner(self, trainer: pl.Trainer, dl: Any = None) -> Any: ...

class BalancedLoaders:
    """The balancer's loaders: installs the plan of ``balancer.planner`` in each loader Lightning prepares.

    Attributes:
        train_sampler: the train loader's balanced sampler, once installed.
    """

    def __init__(self, balancer: _Balancer) -> None:
        self.balancer = balancer
        self.train_sampler: HeteroDistributedSampler | HeteroBatchSampler | None = None
        self.predict_ordered = False
        self._warned: set[str] = set()

    @staticmethod
    def own_batch_sampler(trainer: pl.Trainer) -> HeteroBatchSampler | None:
        """The train loader's ``HeteroBatchSampler`` (installed by the strategy or passed by the user)."""
        dl = trainer.train_dataloader
        bs = dl.batch_sampler if isinstance(dl, DataLoader) else None
        return bs if isinstance(bs, HeteroBatchSampler) else None

    @staticmethod
    def can_balance(dl: object) -> bool:
        """Whether per-rank batch sizes can be installed in train loader ``dl``."""
        return can_balance(dl)

    @staticmethod
    def loader_batch_sizes(trainer: pl.Trainer) -> list[int] | None:
        """Every rank's batch size under the train loader's own batch sampler (``None``: not a batched loader)."""
        found = loader_plan(trainer.train_dataloader, trainer.world_size)
        return None if found is None else found[0]

    def prepare(self, dataloader: object, trainer: pl.Trainer) -> object:
        """Install per-rank batch sizes in a loader Lightning prepared (for the stage running now)."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        stage = trainer.state.stage
        balance_eval = self.balancer.options.balance_eval
        if stage == RunningStage.TRAINING:
            return self._train_loader(dataloader, trainer)
        elif stage == RunningStage.PREDICTING and balance_eval:
            return self._predict_loader(dataloader, trainer)
        elif balance_eval and stage is not None:
            self.install(dataloader, trainer, train=False)
        return dataloader

    def _train_loader(self, dl: DataLoader, trainer: pl.Trainer) -> DataLoader:
        """The train loader with a :class:`HeteroBatchSampler` in place of Lightning's ``DistributedSampler``:
        same dataset, seed, shuffling and ``drop_last``; batches drawn step by step, so plans can change
        mid-epoch."""
        bs = dl.batch_sampler
        if type(bs) is not BatchSampler or type(bs.sampler) is not DistributedSampler:
            self.install(dl, trainer, train=True)  # a user HeteroBatchSampler, or a warning
            return dl
        inner = bs.sampler
        planner = self.balancer.ensure_planner(trainer, dl)
        if planner is None:
            return dl
        hb = HeteroBatchSampler(
            len(inner.dataset), planner.plan, trainer.global_rank, shuffle=inner.shuffle, seed=inner.seed,  # type: ignore[arg-type]
            drop_last=bool(inner.drop_last or bs.drop_last), locality=self.balancer.options.locality,
        )
        hb.set_epoch(trainer.current_epoch)
        self.train_sampler = hb
        if type(dl) not in (DataLoader, ResumableLoader):
            self.warn_once("subclass", (
                f"BatchBalancer: the train loader is a {type(dl).__name__}; it is rebuilt as a plain DataLoader with "
                "the balanced batch sampler, so methods your subclass overrides (e.g. __iter__) do not run. HINT: "
                "move that logic into the Dataset or a collate_fn."))
        return loader_like(dl, hb, resumable=True)

    def _predict_loader(self, dl: DataLoader, trainer: pl.Trainer) -> DataLoader:
        """A loader over this rank's contiguous slice of the prediction order, in batches of its planned size.

        Lightning's prediction sampler hands out every world-size-th sample with equal counts; the order it
        would visit is kept (its ``dataset`` maps positions to indices), cut into contiguous per-rank slices
        sized by the plan, so that concatenating all ranks' outputs restores the dataset order.
        """
        if sized_len(dl.dataset) is None:
            self.warn_once("unsized", UNSIZED)
            return dl
        inner = getattr(dl.batch_sampler, "sampler", None)
        local = getattr(dl.batch_sampler, "batch_size", None)
        if not isinstance(inner, DistributedSampler) or not isinstance(local, int):
            self.warn_once("predict", "BatchBalancer: the predict loader is not a batched DataLoader with "
                           "Lightning's distributed sampler; predictions keep equal batches and rank order.")
            return dl
        positions = inner.dataset  # Lightning's wrapper: position -> index of the user's sampler order
        order = [int(positions[p]) for p in range(len(positions))]  # type: ignore[arg-type]
        plan = self._plan_for(trainer, False, local, trainer.world_size)
        if len(order) >= trainer.world_size and any(lo >= hi for lo, hi in contiguous_split(len(order), plan)):
            plan = [1] * trainer.world_size  # too few samples to share by speed: a rank left none fails Lightning
        self.predict_ordered = True
        return loader_like(dl, HeteroInferenceBatchSampler(order, plan, trainer.global_rank))

    def gather_predictions(self, trainer: pl.Trainer) -> None:
        """Every rank's predictions, concatenated in rank order, which is dataset order (see ``_predict_loader``)."""
        if not self.predict_ordered or trainer.world_size == 1:
            return
        predictions = trainer.predict_loop.predictions
        if not isinstance(predictions, list) or (predictions and isinstance(predictions[0], list)):
            return  # several predict loaders: left as Lightning returns them
        gathered: list[Any] = []
        for src in range(trainer.world_size):
            gathered += trainer.strategy.broadcast(list(predictions) if trainer.global_rank == src else None, src=src)
        predictions[:] = gathered

    def install(self, dl: DataLoader, trainer: pl.Trainer, train: bool) -> bool:
        """Put the plan into ``dl``'s batch sampler in place; ``False`` (and a warning) if it cannot be."""
        bs = dl.batch_sampler
        rank, world = trainer.global_rank, trainer.world_size
        if type(bs) is BatchSampler and isinstance(bs.sampler, ResumedSampler):
            bs.sampler = bs.sampler.sampler  # the resumed epoch is over: whole epochs again
        if sized_len(dl.dataset) is None:
            self.warn_once("unsized", UNSIZED)
            return False
        if isinstance(bs, HeteroBatchSampler):
            sampler: HeteroDistributedSampler = bs.sampler
            local_batch = None
        elif type(bs) is BatchSampler and isinstance(bs.sampler, (HeteroDistributedSampler, DistributedSampler)):
            sampler = bs.sampler  # type: ignore[assignment]
            local_batch = bs.batch_size
        else:
            if world == 1:  # one rank has nothing to rebalance (Lightning keeps a plain sampler there)
                return False
            kind = type(getattr(bs, "sampler", bs)).__name__
            self.warn_once(
                f"sampler-{kind}",
                f"BatchBalancer: cannot rebalance a loader whose sampler is {kind}; its batches stay equal. "
                "HINT: let Lightning inject its DistributedSampler (use_distributed_sampler=True) or pass a "
                "hetero_plugins.HeteroBatchSampler as batch_sampler.",
            )
            return False
        if isinstance(sampler, DistributedSampler) and not isinstance(sampler, HeteroDistributedSampler):
            if type(sampler) is not DistributedSampler:
                self.warn_once("dsw", (
                    f"BatchBalancer: cannot rebalance {type(sampler).__name__} (Lightning's wrapper of a custom "
                    "sampler, e.g. WeightedRandomSampler); batches stay equal and plan_history says "
                    "plan_applied=False. HINT: to balance, draw the samples in the Dataset (e.g. a resampled "
                    "index list) and let Lightning inject its plain DistributedSampler."))
                return False
            n = len(sampler.dataset)  # type: ignore[arg-type]
            drop_last = bool(sampler.drop_last or bs.drop_last)  # type: ignore[union-attr]
            plan = self._plan_for(trainer, train, int(local_batch), world, dl=dl)  # type: ignore[arg-type]
            sampler = HeteroDistributedSampler(
                n, plan, rank, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=drop_last,
                locality=self.balancer.options.locality, pad_to_world_size=train,
            )
            sampler.set_epoch(trainer.current_epoch)
            bs.sampler = sampler  # type: ignore[union-attr]
        else:
            local = sampler.batch_size if local_batch is None else int(local_batch)
            plan = self._plan_for(trainer, train, local, world, current=sampler.plan, dl=dl)
            if isinstance(bs, HeteroBatchSampler):
                bs.set_plan(plan)
            else:
                sampler.set_plan(plan)
        if isinstance(bs, BatchSampler):
            bs.batch_size = plan[rank]
        if train:
            self.train_sampler = bs if isinstance(bs, HeteroBatchSampler) else sampler
        return True

    def resume(self, dl: object, trainer: pl.Trainer, steps_done: int, applied: bool) -> int:
        """Make train loader ``dl`` (a stock strategy's, not yet iterated) run a resumed epoch from step
        ``steps_done`` on: the epoch's plan installed if it ran one (``applied``), and each rank's first
        ``steps_done`` batches skipped. Returns the samples this rank skips (0: the loader cannot resume)."""
        if not isinstance(dl, DataLoader) or type(dl.batch_sampler) is not BatchSampler or steps_done <= 0:
            return 0
        bs = dl.batch_sampler
        if applied and not self.install(dl, trainer, train=True):
            return 0
        if isinstance(bs.sampler, ResumedSampler) or bs.batch_size is None:
            return 0
        skip = steps_done * int(bs.batch_size)  # every step before the last is full on every rank
        bs.sampler = ResumedSampler(bs.sampler, skip)
        return skip

    def _plan_for(
        self, trainer: pl.Trainer, train: bool, local_batch: int, world: int,
        current: Sequence[int] | None = None,
        dl: object = None,
    ) -> list[int]:
        planner = self.balancer.ensure_planner(trainer, dl) if train else self.balancer.planner
        if train and planner is not None:
            return list(planner.plan)
        if current is not None and not train and planner is None:
            return list(current)
        # Evaluation: same global eval batch, shared in proportion to the training plan.
        global_eval = local_batch * world if current is None else sum(current)
        shares = [1.0 / world] * world if planner is None else [b / planner.global_batch for b in planner.plan]
        return largest_remainder([s * global_eval for s in shares], global_eval, Bounds.uniform(world, 1))

    def step_counts(self, trainer: pl.Trainer, batch_idx: int) -> tuple[int, ...] | None:
        """All ranks' sample counts of train step ``batch_idx`` under the installed sampler (``None``: unknown)."""
        s = self.train_sampler
        dl = trainer.train_dataloader
        if s is None or not isinstance(dl, DataLoader):
            return None
        if dl.batch_sampler is not s and _inner(dl.batch_sampler) is not s:
            return None
        try:
            return s.step_counts(batch_idx)
        except IndexError:
            return None

    def warn_once(self, key: str, message: str) -> None:
        """Warn on rank 0, once per ``key`` for these loaders."""
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)
