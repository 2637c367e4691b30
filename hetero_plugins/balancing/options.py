"""``BalancingOptions``: every option of the per-epoch balancing, typed, documented and checked once.

The four classes that balance per-rank batch sizes take the same options: the Lightning callback
``BatchBalancer``, the strategies ``HeteroDDPStrategy`` and ``HeteroHorovodStrategy``, and the self-planning
sampler for ``horovodrun`` scripts ``hetero_plugins.horovod.HeteroBatchSampler``. Each accepts either a
``balancing=BalancingOptions(...)`` object or the same options as keyword arguments (``allocator="lbb",
min_batch_size=8``); :meth:`BalancingOptions.from_kwargs` turns the keywords into the object. Grouping options
in a frozen dataclass follows torch FSDP's config dataclasses (``CPUOffload``, ``MixedPrecision``) and this
project's ``AggregationOptions``.

Example::

    >>> opts = BalancingOptions(allocator="lbb", min_batch_size=8)
    >>> opts.planner(world_size=2, global_batch=64).plan
    [32, 32]
    >>> kwargs = {"policy": "lbb", "process_group_backend": "gloo"}
    >>> BalancingOptions.from_kwargs(None, kwargs).allocator, kwargs
    ('lbb', {'process_group_backend': 'gloo'})
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetero_plugins._validation import check_bool, check_float, check_int, check_path
from hetero_plugins.balancing.allocators import Allocator
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.cluster import ClusterSource, resolve_cluster_source

__all__ = ["BalancingOptions", "check_keywords", "resolve_policy"]


def resolve_policy(allocator: str | Allocator | None, policy: str | Allocator | None) -> str | Allocator:
    """``allocator`` and its alias ``policy``: the one given (default ``"auto"``); both must agree.

    Example::

        >>> resolve_policy(None, "lbb"), resolve_policy(None, None)
        ('lbb', 'auto')
    """
    if allocator is not None and policy is not None and allocator != policy:
        raise ValueError(
            f"`allocator`={allocator!r} and `policy`={policy!r} disagree; `policy` is an alias of `allocator`. "
            "HINT: give only one of them."
        )
    chosen = policy if policy is not None else allocator
    return "auto" if chosen is None else chosen


def check_keywords(owner: str, given: Iterable[str], accepted: Iterable[str], where: str) -> None:
    """Raise a ``TypeError`` naming the first keyword of ``given`` that is not in ``accepted`` (with the closest
    accepted names as a "did you mean" hint), so a mistyped option fails when ``owner`` is built, not later
    inside every rank.

    Example::

        >>> check_keywords("BatchBalancer", ["allocater"], ["allocator", "policy"], "BalancingOptions")
        Traceback (most recent call last):
        ...
        TypeError: BatchBalancer got an unexpected keyword argument 'allocater'. HINT: did you mean 'allocator'? \
The keywords are those of BalancingOptions.
    """
    names = sorted(set(accepted))
    for key in given:
        if key in names:
            continue
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        guess = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise TypeError(f"{owner} got an unexpected keyword argument {key!r}. HINT: {guess}The keywords are those "
                        f"of {where}.")


def _flag(name: str, value: Any, hint: str) -> bool:
    """``value`` as a ``bool``: ``True``/``False`` (or the integers 1/0), never a string such as ``"no"``."""
    if not isinstance(value, bool) and isinstance(value, int) and value in (0, 1):
        return bool(value)
    return check_bool(name, value, hint=hint)


@dataclass(frozen=True)
class BalancingOptions:
    """The options of per-epoch batch balancing, shared by every class that balances.

    Args:
        allocator: how a plan is made from the per-rank time models: ``"auto"`` (default: the two-stage
            scheduler's safe policy, :class:`~hetero_plugins.scheduler.policy.AutoAllocator`: the exact
            equal-finish split, on lines corrected for announced co-runner changes when the run's measurements
            or the NCF support it; without a cluster description it is ``"equal_finish"``, plan for plan),
            ``"equal_finish"`` (all ranks predicted to finish a step together), ``"lbb"`` (LBB, Yao et al.
            2024), ``"proportional"``, ``"static"``, the learned ``"dqn"``, or an
            :class:`~hetero_plugins.balancing.allocators.Allocator`. The glue classes also accept it as
            ``policy=`` (the learned scheduler's name for it); giving both with different values is an error.
        min_batch_size: smallest local batch a rank may get (raise it for BatchNorm models).
        max_batch_size: largest local batch a rank may get; ``None`` for no cap besides measured GPU memory.
        min_gain: a new plan must be predicted this much faster (relative) to replace the current one, so
            noise does not make plans flap (AdaptDL's speed-up threshold; LBB's hysteresis).
        half_life: forgetting of the per-rank time models, in observed steps.
        warmup_steps: first observed steps of the run that the time models ignore (lazy initialisation).
        count_data_time: count each rank's measured wait for its next batch (data loading) in its predicted step
            time, so that a rank whose input pipeline stalls it gets fewer samples; ``False`` splits on compute
            time alone.
        extrapolate: how a rank's step time is priced beyond the largest batch it has measured:
            ``"proportional"`` (default) in proportion to the batch from its time there, so that a saturation
            plateau's flat line does not hand one rank a batch it has never run at almost for free;
            ``"line"`` by the fitted line (see :class:`~hetero_plugins.balancing.planner.BalancePlanner`).
            Used by ``"auto"``, ``"equal_finish"`` and ``"dqn"``.
        cliff_epochs: epochs a rank remembers what each batch size it ran cost, so that past a memory cliff it
            has crossed (a larger batch that ran more than 10% slower than its line predicts) its time grows along
            the chord to that batch instead of the split swinging it across the cliff and back (default 4;
            ``0`` turns the memory off; :mod:`hetero_plugins.balancing.cliffs`). Same allocators as ``extrapolate``.
        regime_reset: at an epoch boundary where the cluster announces a co-runner arriving or leaving beside a
            rank (``"auto"`` and ``"dqn"`` with ``cluster=``), that rank's time model forgets its measured levels
            (its fixed cost stays) and learns the new speed from its first steps, instead of fitting one line
            through steps of both (default ``True``; ``False`` fits across, until the change test finds it).
        locality: keep each rank's shard of the data across epochs and plan changes (LOFT); by default every
            step's samples over all ranks are exactly those stock DDP's sampler would give.
        balance_eval: give validation/test/predict loaders per-rank batch sizes too (Lightning strategies).
        replan_every: within an epoch, every this many steps the ranks exchange their latest step times and
            rank 0 may change the plan for the rest of the epoch (a rank that slows down is rebalanced within
            about ten steps; the step unions stay those of the epoch's order). Needs the strategy's (or a
            user-supplied) balanced batch sampler and ``locality=False``; ``None`` plans at epoch ends only.
        memory_headroom: fraction of GPU memory the per-rank memory cap lets a batch use (Lightning).
        log_metrics: log ``hetero/*`` metrics through the LightningModule's logger (Lightning).
        cluster: where the cluster manager says what runs where (stage 2 of the learned scheduler): the path
            of a JSON file re-read at every epoch boundary, or a callable ``epoch -> dict`` (picklable under
            ``ddp_spawn``); default the file named by ``HETERO_PLUGINS_CLUSTER``, else none. Format in
            :mod:`hetero_plugins.cluster`: each rank's device type and co-runner for the epoch, and free slots.
            Rank 0 reads it: allocators with ``set_context`` (``"dqn"``, ``"auto"``) get the co-runner changes
            and the measured data times before each epoch-end decision.
        relocation: with free slots in the cluster description, rank 0 decides at every epoch end whether
            moving ranks to them pays for a restart (``True``: with ``allocator="auto"`` the model-based
            :class:`~hetero_plugins.scheduler.planning.PlanningRelocator` with the shipped critic (a learned
            correction of its rollout values) under ``auto``'s guard, with any
            other allocator the greedy :class:`~hetero_plugins.scheduler.relocation.Relocator`; 60 s per restart;
            ``False``: off; or a ``Relocator``). A gaining relocation is logged, added to ``plan_history`` as ``relocation`` and
            written as a restart spec, with a ``RuntimeWarning`` naming the gain.
        restart_spec: where the restart spec goes (default ``<default_root_dir>/hetero_restart.json`` under
            Lightning, ``hetero_restart.json`` in the working directory for ``horovodrun`` scripts).
        apply_relocation: Lightning under torchrun with restarts left (``--max-restarts``): apply a relocation
            whose moves stay on their hosts. Every rank saves a checkpoint beside the spec and stops with
            ``RelocationRestart``; torchrun starts the workers again, ``Trainer.fit(...,
            ckpt_path=resume_checkpoint(spec))`` resumes, each moved rank runs on its slot's ``index`` (with
            ``HeteroDDPStrategy``) and starts from the NCF-predicted time line of the slot. Needs
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment (with the agent's shared store,
            restarted workers can read stale addresses); without it, in plain runs, for moves across hosts or
            with no restarts left, the spec is only written.
        hosts_file: elastic ``horovodrun`` scripts only: the file the job's ``--host-discovery-script`` prints
            (``host:slots`` lines). Rank 0 applies a relocation whose slots name their ``host`` by rewriting
            it: one slot fewer on the moved rank's host, one more on the free slot's. Horovod then stops the
            worker on the old host and starts one on the new; after the reset each rank's time model follows
            its host, and the new worker starts from the NCF-predicted line of its slot (from the restart spec).

    Which class uses what: ``BatchBalancer`` and both strategies use every option but ``hosts_file`` (refused
    there). ``hetero_plugins.horovod.HeteroBatchSampler`` plans at ``set_epoch`` only and has no evaluation
    loaders, metrics logger or torchrun restarts: it refuses ``balance_eval``, ``memory_headroom``,
    ``log_metrics`` and ``apply_relocation`` set away from their defaults, and ``replan_every`` other than the
    default or ``None``.

    Raises:
        ValueError: on construction, for any unusable value; the message names the option, the value and the fix.
    """

    allocator: str | Allocator = "auto"
    min_batch_size: int = 1
    max_batch_size: int | None = None
    min_gain: float = 0.03
    half_life: float = 6.0
    warmup_steps: int = 1
    count_data_time: bool = True
    extrapolate: str = "proportional"
    cliff_epochs: int = 4
    regime_reset: bool = True
    locality: bool = False
    balance_eval: bool = True
    replan_every: int | None = 5
    memory_headroom: float = 0.9
    log_metrics: bool = True
    cluster: ClusterSource | None = None
    relocation: bool | Any = True
    restart_spec: str | os.PathLike[str] | None = None
    apply_relocation: bool = True
    hosts_file: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.allocator is None:
            raise ValueError("`allocator`=None is not an allocator. HINT: leave it out for 'auto' (the default), or "
                             "name one such as 'equal_finish'.")
        # The planner's own checks name each option: build a one-rank planner on the options and drop it.
        BalancePlanner(
            world_size=1,
            global_batch=max(int(self.min_batch_size), 1)
            if isinstance(self.min_batch_size, numbers.Integral) and not isinstance(self.min_batch_size, bool) else 1,
            allocator=self.allocator, min_batch_size=self.min_batch_size, max_batch_size=self.max_batch_size,
            min_gain=self.min_gain, half_life=self.half_life, warmup_steps=self.warmup_steps,
            extrapolate=self.extrapolate, cliff_epochs=self.cliff_epochs, regime_reset=self.regime_reset,
        )
        self._set("min_gain", float(self.min_gain))
        self._set("half_life", float(self.half_life))
        check_bool("count_data_time", self.count_data_time, hint="False splits on compute time alone")
        self._set("locality", _flag("locality", self.locality, "True keeps each rank's shard across epochs (LOFT)"))
        self._set("balance_eval", _flag("balance_eval", self.balance_eval,
                                        "False leaves validation/test/predict batches equal"))
        self._set("log_metrics", _flag("log_metrics", self.log_metrics, "False logs no hetero/* metrics"))
        if self.replan_every is not None:
            check_int("replan_every", self.replan_every, minimum=1, hint="use None to replan only at epoch ends")
        if self.locality and self.replan_every not in (None, BalancingOptions.replan_every):
            raise ValueError(f"`replan_every`={self.replan_every!r} cannot apply with locality=True: each rank keeps "
                             "its shard for a whole epoch, so plans change at epoch ends only. HINT: leave "
                             "`replan_every` out (or None), or use locality=False for mid-epoch re-plans.")
        self._set("memory_headroom", check_float("memory_headroom", self.memory_headroom, minimum=0.0, maximum=1.0,
                                                 strict_minimum=True, hint="e.g. 0.9"))
        resolve_cluster_source(self.cluster)  # checks a given source; the environment is read by the user
        if not (isinstance(self.relocation, bool) or hasattr(self.relocation, "propose")):
            raise ValueError(f"`relocation`={self.relocation!r} is not usable. HINT: pass True (default Relocator), "
                             "False, or a hetero_plugins.scheduler.relocation.Relocator.")
        self._set("restart_spec", check_path("restart_spec", self.restart_spec, writable=True,
                                             hint="e.g. 'runs/hetero_restart.json', or None"))
        check_bool("apply_relocation", self.apply_relocation, hint="False writes relocations as a restart spec only")
        self._set("hosts_file", check_path(
            "hosts_file", self.hosts_file, must_exist=True,
            hint="pass the file your --host-discovery-script prints (host:slots lines), or None"))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen dataclass's own field in __post_init__

    # ------------------------------------------------------------------ construction from keywords
    @classmethod
    def from_kwargs(cls, options: BalancingOptions | None, kwargs: dict[str, Any]) -> BalancingOptions:
        """The options given to a glue class: ``options`` with the balancing keywords in ``kwargs`` applied.

        Pops every field name of this class (and ``policy``, the alias of ``allocator``) out of ``kwargs``,
        leaving the rest (e.g. a strategy's keywords for DDP). A keyword may set an option that ``options``
        leaves at its default; setting one that ``options`` also sets is an error naming it.

        Example::

            >>> kw = {"min_batch_size": 8, "start_method": "spawn"}
            >>> BalancingOptions.from_kwargs(BalancingOptions(allocator="lbb"), kw).min_batch_size, kw
            (8, {'start_method': 'spawn'})
        """
        if options is not None and not isinstance(options, BalancingOptions):
            raise ValueError(
                f"`balancing` must be a BalancingOptions or None, got {options!r}. HINT: pass options as keywords "
                "(e.g. allocator='lbb') or as balancing=BalancingOptions(allocator='lbb')."
            )
        names = {f.name for f in dataclasses.fields(cls)}
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
        if "policy" in kwargs or "allocator" in given:
            given["allocator"] = resolve_policy(given.get("allocator"), kwargs.pop("policy", None))
        if options is None:
            return cls(**given)
        defaults = cls()
        for name, value in given.items():
            ours = getattr(options, name)
            if ours != getattr(defaults, name):
                raise ValueError(
                    f"`{name}` is given twice: {ours!r} in `balancing` and {value!r} as a keyword. HINT: give it "
                    f"once, e.g. balancing=dataclasses.replace(balancing, {name}={value!r}) and no keyword."
                )
        return dataclasses.replace(options, **given) if given else options

    def refuse(self, owner: str, options: Mapping[str, str], allowed: Mapping[str, Sequence[Any]] | None = None) -> None:
        """Raise a ``ValueError`` if an option that ``owner`` does not use is set away from its default.

        Args:
            owner: the class's name, for the message.
            options: option name -> why it does not apply to ``owner`` (one sentence).
            allowed: option name -> further values accepted besides the default (e.g. ``replan_every=None``).
        """
        defaults = BalancingOptions()
        for name, why in options.items():
            value, default = getattr(self, name), getattr(defaults, name)
            if value == default or value in (allowed or {}).get(name, ()):
                continue
            raise ValueError(f"`{name}`={value!r} does not apply to {owner}: {why} HINT: leave `{name}` out.")

    # ------------------------------------------------------------------ use
    def planner(
        self, world_size: int, global_batch: int, plan: Sequence[int] | None = None,
        allocator: Allocator | None = None,
    ) -> BalancePlanner:
        """A :class:`~hetero_plugins.balancing.planner.BalancePlanner` for ``world_size`` ranks on these options.

        Args:
            world_size: number of ranks.
            global_batch: samples per step over all ranks.
            plan: the first plan (default an equal split).
            allocator: an allocator instance to use instead of a fresh one made from ``self.allocator`` (a caller
                that already holds one, e.g. to keep its learned context).
        """
        return BalancePlanner(
            world_size=world_size, global_batch=global_batch,
            allocator=self.allocator if allocator is None else allocator,
            min_batch_size=self.min_batch_size, max_batch_size=self.max_batch_size, min_gain=self.min_gain,
            half_life=self.half_life, warmup_steps=self.warmup_steps, initial_plan=plan,
            count_data_time=self.count_data_time, extrapolate=self.extrapolate, cliff_epochs=self.cliff_epochs,
            regime_reset=self.regime_reset,
        )
