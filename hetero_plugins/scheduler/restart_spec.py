"""Restart specs: the JSON file a relocation is written to and read back from after a restart.

A spec records a relocation decision (Zhang, Geng, Ma, IEEE TPDS 2021, IAWP; decided by
:class:`~hetero_plugins.scheduler.relocation.Relocator`): every rank's place after the move (``device``,
``corunner``, optional ``host`` and ``index``, ``from`` ``"own"`` or ``"free_slots[k]"``) with its predicted
time line, the moves, the predicted step times and the seconds saved, plus what an integration adds (a
``checkpoint`` with torchrun's ``run_id`` and ``restart_count``, a ``hosts_file``). Rank 0 of an integration
writes it (:func:`write_relocation_spec`, atomically, after checking it); the integrations and the user read
it back (:func:`read_relocation_spec`, :func:`resume_checkpoint`), every field checked
(:func:`check_relocation_spec`). Resume rules: a missing spec is a fresh start, a broken one an error naming
the file, the field and the fix; a checkpoint is resumed only in a later restart of the torchrun run that wrote
it (a stale spec, of another run or outside torchrun, warns and starts from scratch), and a missing checkpoint
that is due raises rather than restarting from scratch unannounced.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hetero_plugins._files import write_atomic
from hetero_plugins.cluster import check_host_name

__all__ = ["RelocationDecision", "check_relocation_spec", "due_relocation_spec", "publish_relocation_spec",
           "read_relocation_spec", "relocation_spec", "resume_checkpoint", "resume_disagreement",
           "torchelastic_restarts", "write_relocation_spec"]


class RelocationDecision(Protocol):
    """What :func:`write_relocation_spec` reads of a decision
    (:class:`~hetero_plugins.scheduler.relocation.Relocation` has it)."""

    @property
    def targets(self) -> Sequence[int | None]:
        """Per rank, the index into the free slots it moves to, or ``None`` (it stays)."""
        ...

    @property
    def lines(self) -> Sequence[tuple[float, float]]:
        """Per rank, the predicted ``(intercept, slope)`` where it runs next."""
        ...

    @property
    def current_step_time(self) -> float:
        """Predicted step time if nobody moves (seconds)."""
        ...

    @property
    def step_time(self) -> float:
        """Predicted step time after the moves (seconds)."""
        ...

    @property
    def saved_seconds(self) -> float:
        """Predicted seconds saved over the horizon, restart cost deducted."""
        ...

    @property
    def moves(self) -> list[tuple[int, int]]:
        """``(rank, free slot index)`` of each rank that moves."""
        ...

    @property
    def predicted_gain(self) -> float:
        """Relative step-time gain."""
        ...


def torchelastic_restarts() -> tuple[str, int, int] | None:
    """``(run id, restart count, max restarts)`` when this process was started by torchrun, else ``None``."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    return run, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def write_relocation_spec(path: str | Path, decision: RelocationDecision, places: Sequence[Mapping[str, Any]],
                          free_slots: Sequence[Mapping[str, Any]], epoch: int | None = None,
                          extra: Mapping[str, Any] | None = None) -> Path | None:
    """Write a relocation as a JSON restart spec and warn naming the predicted gain.

    The spec lists every rank's place after the move (its ``device``, ``corunner`` and, where the cluster
    description gives them, ``host`` and ``index``; ``from`` is ``"own"`` or ``"free_slots[k]"``) with its
    predicted time line (and, for a moved rank, ``batch``: the batch size that line stands for, where the decision
    gives one), the moves, the predicted step times and the seconds saved over the horizon, plus
    ``extra`` (e.g. the checkpoint of a relocation restart). The spec is checked as :func:`read_relocation_spec`
    checks it before anything is written, and the file is replaced atomically through a temporary file of a
    random name in its directory (a file or symlink planted at a predictable name is never written through).
    Returns the path, or ``None`` when nobody moves.

    Raises:
        ValueError: ``decision`` has another number of ranks than ``places``, a move names no entry of
            ``free_slots``, or the spec would not read back (e.g. a negative ``index`` in a place).
    """
    spec = relocation_spec(path, decision, places, free_slots, epoch=epoch, extra=extra)
    if spec is None:
        return None
    return publish_relocation_spec(path, spec)


def relocation_spec(path: str | Path, decision: RelocationDecision, places: Sequence[Mapping[str, Any]],
                    free_slots: Sequence[Mapping[str, Any]], epoch: int | None = None,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The restart spec :func:`write_relocation_spec` writes to ``path``, built and checked but not written
    (``None`` when nobody moves): an integration that must save a checkpoint first writes it afterwards with
    :func:`publish_relocation_spec`, so the spec never names a checkpoint that is not on disk yet.

    Raises:
        ValueError: as :func:`write_relocation_spec`.
    """
    if not decision.moves:
        return None
    if len(decision.targets) != len(places) or len(decision.lines) != len(places):
        raise ValueError(f"`decision` has {len(decision.targets)} ranks but `places` has {len(places)} entries. "
                         "HINT: pass each rank's current place (the cluster view's `places`), one per rank.")
    for r, target in enumerate(decision.targets):
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, np.integer))
                                   or not 0 <= target < len(free_slots)):
            raise ValueError(f"`decision.targets[{r}]`={target!r} names no free slot: `free_slots` has "
                             f"{len(free_slots)} entries. HINT: pass the free slots the decision was made over.")
    ranks = []
    for r, target in enumerate(decision.targets):
        place = dict(places[r]) if target is None else dict(free_slots[int(target)])
        place.pop("data", None)
        ranks.append({"rank": r, **place, "from": "own" if target is None else f"free_slots[{int(target)}]",
                      "line": [float(x) for x in decision.lines[r]]})
        known = getattr(decision, "batches", None) or []
        if target is not None and r < len(known) and known[r] is not None:
            ranks[-1]["batch"] = int(known[r])  # the batch size the predicted line stands for
    spec = {"epoch": epoch, "predicted_gain": decision.predicted_gain,
            "current_step_time_s": decision.current_step_time, "predicted_step_time_s": decision.step_time,
            "saved_seconds": decision.saved_seconds, "ranks": ranks,
            "moves": [{"rank": r, "to_free_slot": int(k)} for r, k in decision.moves], **dict(extra or {})}
    check_relocation_spec(spec, f"the restart spec to write to {str(path)!r}",
                          fix="fix the places, free slots or `extra` it is written from.")
    return spec


def publish_relocation_spec(path: str | Path, spec: Mapping[str, Any]) -> Path:
    """Write a spec built by :func:`relocation_spec` to ``path`` atomically and warn naming the predicted gain."""
    path = Path(path)
    write_atomic(path, json.dumps(spec, indent=2))
    moves = [(m["rank"], m["to_free_slot"]) for m in spec["moves"]]
    action = ("the workers restart with it now" if spec.get("checkpoint")
              else "restart the job with that placement to apply it")
    warnings.warn(
        f"hetero_plugins: moving rank(s) {[r for r, _ in moves]} to free slot(s) "
        f"{[k for _, k in moves]} is predicted to make steps {100 * spec['predicted_gain']:.1f}% faster "
        f"({spec['saved_seconds']:.1f} s saved over the next epochs, restart included); restart spec written to "
        f"{str(path)!r}; {action}.",
        RuntimeWarning, stacklevel=2,
    )
    return path


_FROM = re.compile(r"^free_slots\[(0|[1-9][0-9]*)\]$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_relocation_spec(spec: Any, label: str, world_size: int | None = None,
                          fix: str | None = None) -> dict[str, Any]:
    """``spec`` if every field of a restart spec is well-formed, else a ``ValueError`` naming the field.

    The fields :func:`write_relocation_spec` writes, each checked where present:

    - ``ranks``: a non-empty list, one entry per rank: ``rank`` an int in ``[0, n)`` for ``n`` entries (and in
      ``[0, world_size)`` when ``world_size`` is given), each rank once; a ``device`` name; ``corunner`` a name
      or ``null``; an optional ``host`` name and accelerator ``index`` (an int ``>= 0``); ``from``, ``"own"`` or
      ``"free_slots[k]"``; ``line``, ``[intercept, slope]`` as two finite numbers;
    - ``moves``: ``{"rank", "to_free_slot"}`` entries, ints ``>= 0``, each naming a rank of ``ranks`` at most
      once and agreeing with its entry's ``from``;
    - ``epoch``: an int ``>= 0`` or ``null``; ``predicted_gain``, ``current_step_time_s``,
      ``predicted_step_time_s``, ``saved_seconds``: finite numbers;
    - ``checkpoint`` (then ``run_id``, a string, and ``restart_count``, an int ``>= 0``, are required) and
      ``hosts_file``: file paths.

    Other keys (an integration's ``extra``) pass unchecked.

    Args:
        spec: the parsed spec.
        label: what the errors call it (e.g. ``"restart spec 'runs/hetero_restart.json'"``).
        world_size: the ranks of the job reading it (``None``: not checked against a job).
        fix: the advice closing each error (default: fix the field or delete the file to start fresh).
    """
    tail = fix or ("the spec is written by hetero_plugins (write_relocation_spec); restore it or delete the file "
                   "to start from scratch.")

    def bad(field_name: str, value: Any, what: str) -> ValueError:
        return ValueError(f"{label}: field `{field_name}` is invalid: got {value!r}. HINT: {what}; {tail}")

    if not isinstance(spec, dict):
        raise ValueError(f"{label} is not a JSON object (got {type(spec).__name__}). HINT: {tail}")
    ranks = spec.get("ranks", [])
    if not isinstance(ranks, list) or ("ranks" in spec and not ranks):
        raise bad("ranks", ranks, "`ranks` is a non-empty list with one entry per rank")
    n = len(ranks)
    limit = n if world_size is None else min(n, world_size)
    owner = f"{n} rank(s)" if world_size is None or world_size >= n else f"a job of {world_size} rank(s)"
    seen: dict[int, Mapping[str, Any]] = {}
    for i, entry in enumerate(ranks):
        where = f"ranks[{i}]"
        if not isinstance(entry, dict):
            raise bad(where, entry, 'each entry is {"rank", "device", "corunner", "from", "line", ...}')
        r = entry.get("rank")
        if not _is_int(r) or not 0 <= r < limit:
            raise bad(f"{where}.rank", r, f"ranks are ints in [0, {limit}) for {owner}")
        if r in seen:
            raise bad(f"{where}.rank", r, "each rank has one entry")
        seen[r] = entry
        device = entry.get("device")
        if not isinstance(device, str) or not device:
            raise bad(f"{where}.device", device, 'name the device type, e.g. "v100"')
        corunner = entry.get("corunner")
        if corunner is not None and (not isinstance(corunner, str) or not corunner):
            raise bad(f"{where}.corunner", corunner, "use null (dedicated) or the co-located job's type")
        if entry.get("host") is not None:
            try:
                check_host_name(f"{where}.host", entry["host"])
            except ValueError:
                raise bad(f"{where}.host", entry["host"], "use the node's host name (letters, digits, '-', '_', "
                          "'.')") from None
        index = entry.get("index")
        if index is not None and (not _is_int(index) or index < 0):
            raise bad(f"{where}.index", index, "the accelerator's index on its node is an int >= 0")
        origin = entry.get("from")
        if origin != "own" and not (isinstance(origin, str) and _FROM.match(origin)):
            raise bad(f"{where}.from", origin, 'use "own" or "free_slots[k]" (k an int >= 0)')
        line = entry.get("line")
        if not isinstance(line, list) or len(line) != 2 or not all(_is_number(x) for x in line):
            raise bad(f"{where}.line", line, "a line is [intercept, slope], two finite numbers")
        batch = entry.get("batch")
        if batch is not None and (not _is_int(batch) or batch < 1):
            raise bad(f"{where}.batch", batch, "the batch size a moved rank's line stands for is an int >= 1")
    moves = spec.get("moves", [])
    if not isinstance(moves, list):
        raise bad("moves", moves, 'use a list of {"rank": r, "to_free_slot": k}')
    moved: set[int] = set()
    for j, move in enumerate(moves):
        where = f"moves[{j}]"
        if not isinstance(move, dict) or set(move) != {"rank", "to_free_slot"}:
            raise bad(where, move, 'each move is {"rank": r, "to_free_slot": k}')
        r, k = move["rank"], move["to_free_slot"]
        if not _is_int(r) or r not in seen or r in moved:
            raise bad(f"{where}.rank", r, "a move names a rank listed in `ranks` (each rank at most once)")
        if not _is_int(k) or k < 0:
            raise bad(f"{where}.to_free_slot", k, "a free slot's index is an int >= 0")
        if seen[r].get("from") != f"free_slots[{k}]":
            raise bad(f"{where}.to_free_slot", k, f"it disagrees with ranks entry of rank {r} "
                      f"(from {seen[r].get('from')!r})")
        moved.add(r)
    epoch = spec.get("epoch")
    if epoch is not None and (not _is_int(epoch) or epoch < 0):
        raise bad("epoch", epoch, "the epoch is an int >= 0 or null")
    for key in ("predicted_gain", "current_step_time_s", "predicted_step_time_s", "saved_seconds"):
        if key in spec and not _is_number(spec[key]):
            raise bad(key, spec[key], "a finite number")
    for key in ("checkpoint", "hosts_file"):
        if key in spec and spec[key] is not None and (not isinstance(spec[key], str) or not spec[key]):
            raise bad(key, spec[key], "a file path")
    if spec.get("checkpoint"):
        if not isinstance(spec.get("run_id"), str):
            raise bad("run_id", spec.get("run_id"), "a spec with a checkpoint names torchrun's run id (a string)")
        if not _is_int(spec.get("restart_count")) or spec["restart_count"] < 0:
            raise bad("restart_count", spec.get("restart_count"), "a spec with a checkpoint names torchrun's "
                      "restart count (an int >= 0)")
    return spec


def read_relocation_spec(path: str | Path, world_size: int | None = None) -> dict[str, Any] | None:
    """The restart spec at ``path``, every field checked (:func:`check_relocation_spec`); ``None`` if there is none.

    A missing file is a fresh start (``None``). A file that exists but cannot be read, is empty or truncated
    (not JSON), or holds a field of the wrong type or range raises.

    Args:
        path: the spec file.
        world_size: the ranks of the job reading it: every ``rank`` must then lie in ``[0, world_size)``.

    Raises:
        ValueError: naming the file, the field, the value and the fix.
    """
    path = Path(path)
    label = f"restart spec {str(path)!r}"
    fresh = "delete the file to start from scratch (it is written again at the next relocation)."
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{label} exists but cannot be read ({err}). HINT: make it readable, or {fresh}") from None
    if not text.strip():
        raise ValueError(f"{label} is empty. HINT: a relocation was interrupted while writing it; {fresh}")
    try:
        spec = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{label} is nested too deeply to be a restart spec. HINT: {fresh}") from None
    except ValueError as err:
        raise ValueError(f"{label} is not valid JSON ({err}); it is truncated or not a restart spec. "
                         f"HINT: {fresh}") from None
    return check_relocation_spec(spec, label, world_size)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


#: torchrun's run id when ``--rdzv-id`` is not given (multi-node launches): the same for every run.
_DEFAULT_RUN_ID = "none"


def resume_checkpoint(path: str | Path = "hetero_restart.json") -> str | None:
    """The checkpoint to resume from after a relocation restart, else ``None``.

    Under torchrun, a relocation that the balancer applies saves a checkpoint, records it in the restart spec
    with torchrun's run id and restart count, and stops the workers; torchrun starts them again. Pass this to
    ``Trainer.fit(..., ckpt_path=resume_checkpoint(spec))`` (``spec``: the strategy's ``restart_spec``, default
    ``<default_root_dir>/hetero_restart.json``). What it returns:

    - no spec file: ``None`` (a fresh start), quietly;
    - a spec without a ``checkpoint`` (written for a launcher to apply, e.g. under Horovod or a plain run):
      ``None``, quietly: there is nothing to resume;
    - a spec with a checkpoint, read in a later restart (``TORCHELASTIC_RESTART_COUNT`` above the spec's
      ``restart_count``) of the same torchrun run (``TORCHELASTIC_RUN_ID`` equal to its ``run_id``): the
      checkpoint; a ``ValueError`` if that file does not exist (the job would otherwise start from scratch
      unannounced). A later restart for another reason (a crashed worker) resumes from it too: it is the last
      checkpoint the run wrote. Under torchrun's default run id ``"none"`` (no ``--rdzv-id``), which every run
      shares, a warning says the checkpoint may be another run's;
    - the attempt that wrote the spec (same run, same restart count): ``None``, quietly;
    - a *stale* spec with a checkpoint, one that cannot belong to this run: this process was not started by
      torchrun, the spec names another run id, or a restart count above this attempt's: ``None`` (start from
      scratch) with a ``RuntimeWarning`` naming the file and how to resume or clean up. Modification times are
      not compared (clocks of shared file systems disagree).

    Raises:
        ValueError: the spec exists but is unreadable, empty, truncated or holds a bad field
            (:func:`read_relocation_spec`), or it is due for resuming and its checkpoint is missing.
    """
    spec = read_relocation_spec(path)
    checkpoint, warning = _due_checkpoint(spec, path)
    if warning is not None:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)
    return checkpoint


def due_relocation_spec(path: str | Path, world_size: int | None = None) -> dict[str, Any] | None:
    """The restart spec at ``path`` when this process is a torchrun restart that resumes from its checkpoint
    (:func:`resume_checkpoint` returns that checkpoint), else ``None``; quiet.

    For what must be known before ``Trainer.fit`` restores the checkpoint (``trainer.ckpt_path`` is set only
    then), e.g. the accelerator a moved rank runs on. Outside torchrun the spec is not read; a spec that is due
    is checked against ``world_size``.

    Raises:
        ValueError: as :func:`resume_checkpoint`, and a due spec whose ranks do not fit ``world_size``.
    """
    if torchelastic_restarts() is None:  # only a torchrun restart resumes: the spec is not read
        return None
    spec = read_relocation_spec(path)
    checkpoint, _ = _due_checkpoint(spec, path)
    if spec is None or checkpoint is None:
        return None
    return check_relocation_spec(spec, f"restart spec {str(path)!r}", world_size)


def _due_checkpoint(spec: dict[str, Any] | None, path: str | Path) -> tuple[str | None, str | None]:
    """``(checkpoint to resume or None, warning or None)`` by :func:`resume_checkpoint`'s rules."""
    if spec is None or not spec.get("checkpoint"):
        return None, None
    label = f"restart spec {str(path)!r}"
    elastic = torchelastic_restarts()
    written = f"torchrun run {spec['run_id']!r}, attempt {spec['restart_count']}"
    stale_fix = (f"HINT: to resume, pass Trainer.fit(..., ckpt_path={spec['checkpoint']!r}) yourself; otherwise "
                 "delete the spec to silence this.")
    if elastic is None:
        return None, (f"hetero_plugins: {label} names checkpoint {spec['checkpoint']!r} from {written}, but this "
                      "process was not started by torchrun: starting from scratch. " + stale_fix)
    run, count, _ = elastic
    if spec["run_id"] != run or count < spec["restart_count"]:
        return None, (f"hetero_plugins: {label} is stale: it names checkpoint {spec['checkpoint']!r} from "
                      f"{written}, and this is run {run!r}, attempt {count}: starting from scratch. " + stale_fix)
    if count == spec["restart_count"]:
        return None, None  # this attempt wrote it and has not restarted yet
    checkpoint = str(spec["checkpoint"])
    if not Path(checkpoint).is_file():
        raise ValueError(f"{label}: field `checkpoint` names {checkpoint!r}, which does not exist, so restart "
                         f"{count} of torchrun run {run!r} cannot resume from it. HINT: restore the checkpoint "
                         "(it is written beside the spec before the workers stop), or delete the spec to start "
                         "from scratch.")
    if run == _DEFAULT_RUN_ID:
        return checkpoint, (f"hetero_plugins: resuming from {checkpoint!r} ({label}) under torchrun's default run "
                            f"id {run!r}, which every run launched without --rdzv-id shares: the checkpoint may be "
                            "an earlier run's. HINT: launch torchrun with a unique --rdzv-id (e.g. the job id).")
    return checkpoint, None


def resume_disagreement(resumed: list[bool], spec: str) -> str | None:
    """Why ranks that resumed from a checkpoint (``resumed[r]``) cannot train beside ranks that start afresh, else
    ``None`` when all agree. Ranks on a node whose folder lacks the restart spec (written by rank 0 on its own
    node) start afresh after a relocation restart while the others resume: they would exchange gradients across
    different epochs until one side finishes."""
    if all(resumed) or not any(resumed):
        return None
    ahead = [r for r, x in enumerate(resumed) if x]
    fresh = [r for r, x in enumerate(resumed) if not x]
    return (f"rank(s) {ahead} resume from a checkpoint but rank(s) {fresh} start from scratch: they would train "
            f"different epochs together. After a relocation restart every rank must find the restart spec {spec!r} "
            "and the checkpoint beside it. HINT: put `restart_spec` on a file system every node shares (e.g. "
            "HeteroDDPStrategy(restart_spec='/shared/run/hetero_restart.json')) and pass the same "
            "Trainer.fit(..., ckpt_path=resume_checkpoint(that path)) on every rank.")
