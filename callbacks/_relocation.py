"""Relocations under torchrun: the restart spec, the checkpoint-and-restart, and adopting it on resume.

At an epoch end rank 0 may decide that moving ranks to free slots pays for a restart (the coordinator asks
the ``ClusterAdvisor``). Under torchrun with restarts left, a relocation whose moves stay on their hosts is
applied: every rank checkpoints beside the spec and stops with :class:`RelocationRestart`; torchrun starts
the workers again, and ``Trainer.fit(..., ckpt_path=resume_checkpoint(spec))`` resumes, the moved ranks'
time models starting from the NCF-predicted lines of their slots.

The order keeps a crash at any point resumable: the checkpoint is saved first (under a name of its own per
attempt and epoch, so an earlier spec never names a file being rewritten), and only then does rank 0 write the
spec that names it. A worker dying before that leaves the earlier spec (or none) in force, and torchrun's
restart resumes from what it names (or starts afresh), never from a spec whose checkpoint is missing.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from hetero_plugins.balancing.coordinator import PlanCoordinator
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.scheduler.restart_spec import resume_disagreement  # noqa: F401 - re-exported

log = logging.getLogger("hetero_plugins.callbacks.batch_balancer")

__all__ = ["RelocationRestart", "adopt_relocation", "due_relocation", "resume_disagreement", "resumed_relocation",
           "restart_for_relocation", "spec_path", "write_torchrun_relocation"]

#: Rank 0's specs built at a decision and written once their checkpoint is on disk, by checkpoint path.
_PENDING: dict[str, dict[str, Any]] = {}


class RelocationRestart(RuntimeError):
    """Raised on every rank to stop the workers so that torchrun restarts them with a relocation applied."""


def spec_path(options: BalancingOptions, trainer: pl.Trainer) -> str:
    """Where the restart spec goes: ``restart_spec``, or ``<default_root_dir>/hetero_restart.json``."""
    return str(options.restart_spec or os.path.join(trainer.default_root_dir, "hetero_restart.json"))


def resumed_relocation(options: BalancingOptions, trainer: pl.Trainer) -> dict[str, Any] | None:
    """The restart spec this fit resumes from (its checkpoint is ``trainer.ckpt_path``), else ``None``."""
    from hetero_plugins.scheduler.restart_spec import check_relocation_spec, read_relocation_spec

    ckpt = trainer.ckpt_path
    if not ckpt:  # a fresh fit: a spec left in the folder (another job's, of another world size) is not read
        return None
    path = spec_path(options, trainer)
    spec = read_relocation_spec(path)
    if spec is None or not spec.get("checkpoint") or os.path.abspath(str(ckpt)) != os.path.abspath(spec["checkpoint"]):
        return None
    return check_relocation_spec(spec, f"restart spec {path!r}", world_size=trainer.world_size)


def due_relocation(options: BalancingOptions, trainer: pl.Trainer) -> dict[str, Any] | None:
    """The restart spec this torchrun attempt restarts into (``resume_checkpoint`` returns its checkpoint), known
    before ``Trainer.fit`` restores the checkpoint (``trainer.ckpt_path`` is set only then), else ``None``."""
    from hetero_plugins.scheduler.restart_spec import due_relocation_spec

    return due_relocation_spec(spec_path(options, trainer), world_size=trainer.world_size)


def write_torchrun_relocation(trainer: pl.Trainer, options: BalancingOptions, warn_once: Callable[[str, str], None],
                              info: dict[str, Any], decision: Any, upcoming: Any) -> None:
    """Rank 0, for a new gaining relocation: write the spec; under torchrun with restarts left and moves that stay
    on their hosts, name the checkpoint every rank saves before the restart (``info["checkpoint"]``)."""
    from hetero_plugins.scheduler.restart_spec import relocation_spec, torchelastic_restarts, write_relocation_spec

    path = spec_path(options, trainer)
    extra: dict[str, Any] = {}
    elastic = torchelastic_restarts()
    places = upcoming.places
    same_host = all(places[r].get("host") is None or upcoming.free_slots[k].get("host") is None
                    or places[r]["host"] == upcoming.free_slots[k]["host"] for r, k in decision.moves)
    restarts_left = elastic is not None and elastic[1] < elastic[2]
    if options.apply_relocation and restarts_left and same_host and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warn_once("shared-store", (
            "BatchBalancer: not restarting to apply the relocation: torchrun shares its rendezvous store "
            "with the workers, and restarted workers can then read the previous attempt's addresses and "
            "fail to connect (PyTorch issue #135712). HINT: launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to let relocations restart the workers."))
    elif options.apply_relocation and restarts_left and same_host:
        # A name of its own per attempt and epoch: the spec in force may name the last relocation's checkpoint.
        name = f"hetero_relocation-attempt{elastic[1]}-epoch{info['epoch']}.ckpt"  # type: ignore[index]
        extra = {"checkpoint": os.path.join(os.path.dirname(os.path.abspath(path)), name),
                 "run_id": elastic[0], "restart_count": elastic[1]}  # type: ignore[index]
    elif options.apply_relocation and elastic is not None and not same_host:
        log.warning("BatchBalancer: the relocation moves ranks across hosts, which a torchrun restart "
                    "cannot do; the spec is written for the launcher.")
    if extra:  # written by restart_for_relocation once every rank's checkpoint is saved
        spec = relocation_spec(path, decision, places, upcoming.free_slots, epoch=info["epoch"], extra=extra)
        _PENDING[extra["checkpoint"]] = {"path": path, "spec": spec}
        info["spec"] = path
    else:
        info["spec"] = str(write_relocation_spec(path, decision, places, upcoming.free_slots,
                                                 epoch=info["epoch"], extra=extra))
    info["checkpoint"] = extra.get("checkpoint")
    log.warning("BatchBalancer: relocation %s predicted %.1f%% faster; spec %s", decision.moves,
                100 * decision.predicted_gain, info["spec"])


def restart_for_relocation(trainer: pl.Trainer, info: dict[str, Any]) -> None:
    """Every rank: checkpoint; rank 0 then writes the spec naming it; stop so that torchrun restarts the workers on
    the new placement. If rank 0 cannot write the spec, every rank warns and trains on in place."""
    trainer.save_checkpoint(info["checkpoint"])
    trainer.strategy.barrier("hetero_relocation")
    problem = None
    if trainer.is_global_zero:
        problem = _publish_pending(info["checkpoint"])
    problem = trainer.strategy.broadcast(problem, src=0)
    if problem is not None:
        info["checkpoint"] = None
        warnings.warn(f"BatchBalancer: not restarting to apply the relocation {info['moves']}: the restart spec "
                      f"{info['spec']!r} could not be written ({problem}); training goes on in place. HINT: make "
                      "`restart_spec` (default <default_root_dir>/hetero_restart.json) writable.", RuntimeWarning,
                      stacklevel=2)
        return
    raise RelocationRestart(
        f"hetero_plugins: stopping the workers to apply the relocation {info['moves']} (rank, free slot), "
        f"predicted {100 * info['predicted_gain']:.1f}% faster steps; torchrun restarts them, and "
        f"Trainer.fit(..., ckpt_path=resume_checkpoint({info['spec']!r})) resumes from {info['checkpoint']!r}.")


def _publish_pending(checkpoint: str) -> str | None:
    """Rank 0: write the spec built for ``checkpoint`` (now on disk); drop the checkpoint of the spec it replaces
    when the same torchrun run wrote both. Returns why it could not be written, else ``None``."""
    from hetero_plugins.scheduler.restart_spec import publish_relocation_spec, read_relocation_spec

    pending = _PENDING.pop(checkpoint, None)
    if pending is None:
        return "no restart spec was prepared on rank 0"
    try:
        previous = read_relocation_spec(pending["path"])
    except ValueError:
        previous = None
    try:
        publish_relocation_spec(pending["path"], pending["spec"])
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    old = (previous or {}).get("checkpoint")
    same_run = previous is not None and previous.get("run_id") == pending["spec"].get("run_id")  # never another run's
    if old and same_run and os.path.abspath(old) != os.path.abspath(checkpoint) and \
            os.path.dirname(os.path.abspath(old)) == os.path.dirname(os.path.abspath(checkpoint)) and \
            os.path.basename(old).startswith("hetero_relocation"):
        try:  # the last relocation's checkpoint: no spec names it any more
            os.remove(old)
        except OSError:
            pass
    return None


def adopt_relocation(trainer: pl.Trainer, coordinator: PlanCoordinator, spec: dict[str, Any]) -> None:
    """After a relocation restart: moved ranks start from their slot's predicted line; plan again (collective)."""
    planner = coordinator.planner
    moved = {int(m["rank"]) for m in spec.get("moves", [])}
    for entry in spec.get("ranks", []):
        r = int(entry["rank"])
        if r in moved and r < planner.world_size and entry.get("line"):
            planner.seed_model(r, entry["line"], batch_size=entry.get("batch"))
    coordinator.replan()
    if trainer.is_global_zero:
        log.info("BatchBalancer: resumed after relocating rank(s) %s; plan %s", sorted(moved), planner.plan)
