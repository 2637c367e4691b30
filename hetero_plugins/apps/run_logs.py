"""Reading what a run leaves behind: a checkpoint's balancer state, TensorBoard or CSV ``hetero/*`` metrics,
a plan-history JSON or a restart spec, as one :class:`RunRecord` (``hetero-plugins report`` draws it)."""

from __future__ import annotations

import csv
import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunRecord", "SPEC_NAME", "check_history", "load_run", "read_csv_scalars", "read_tensorboard_scalars"]

SPEC_NAME = "hetero_restart.json"
_CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")


@dataclass
class RunRecord:
    """What a run left behind, as the planner's per-epoch history.

    Attributes:
        source: the file the history was read from.
        kind: ``"checkpoint"``, ``"tensorboard"``, ``"csv"``, ``"json"`` or ``"restart spec"``.
        history: one dict per epoch in the format of ``BatchBalancer.plan_history`` (keys a source lacks are
            absent or ``None``).
        world_size, global_batch: from the balancer's state or the plans (``None`` if unknown).
        restart_spec, spec_path: the restart spec read beside the run, if any.
        lr_scale: ``hetero/lr_scale`` values of a log (``LRAdapter``), in step order.
        notes: what was chosen or skipped while reading, for the summary.
    """

    source: Path
    kind: str
    history: list[dict[str, Any]]
    world_size: int | None = None
    global_batch: int | None = None
    restart_spec: dict[str, Any] | None = None
    spec_path: Path | None = None
    lr_scale: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- reading
def load_run(path: str | Path) -> RunRecord:
    """Read a run from a checkpoint, a TensorBoard or CSV log, a plan-history JSON, a restart spec, or a folder.

    Raises:
        ValueError: ``path`` does not exist or holds nothing this report can read (the message says what was
            looked for).
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"`RUN`={str(path)!r} does not exist. HINT: give a checkpoint (.ckpt), a log folder such as "
                         "lightning_logs/version_0, a metrics.csv, or a folder holding them.")
    notes: list[str] = []
    record = _from_file(p, notes) if p.is_file() else _from_folder(p, notes)
    if record is None:
        raise ValueError(
            f"`RUN`={str(path)!r} holds no balancer state, no hetero/* metrics, no plan history and no restart spec. "
            "HINT: train with HeteroDDPStrategy or the BatchBalancer callback and keep a checkpoint "
            "(Lightning's default ModelCheckpoint) or a logger (TensorBoardLogger, CSVLogger); then point this "
            "command at the checkpoint or at the run's folder.")
    record.notes = notes + record.notes
    check_history(record.history, repr(str(record.source)))
    if record.kind == "restart spec":
        record.restart_spec = _check_spec(record.restart_spec, record.spec_path or record.source)
    elif record.restart_spec is None:
        spec_path = _find_spec(p, record.source)
        if spec_path is not None:
            try:  # a broken spec beside a readable run: report the run, say why the spec was left out
                record.restart_spec, record.spec_path = _check_spec(_read_json(spec_path), spec_path), spec_path
            except ValueError as err:
                record.notes.append(f"skipped {err}")
    if record.world_size is None:
        sizes = [e.get("batch_sizes") for e in record.history if e.get("batch_sizes")]
        if sizes:
            record.world_size, record.global_batch = len(sizes[0]), int(sum(sizes[0]))
    return record


def _check_spec(spec: Any, path: Path) -> dict[str, Any]:
    """A restart spec read beside or as the run, the fields the report reads checked (``moves``, ``epoch``,
    ``predicted_gain``, ``checkpoint``); ``ValueError`` naming the file, the field, the value and the fix."""
    label = f"restart spec {str(path)!r}"
    fix = ("HINT: it is written by hetero_plugins when a relocation is decided (write_relocation_spec); restore it, "
           "or delete it to report the run without it.")
    if not isinstance(spec, dict):
        what = "is not readable JSON" if spec is None else f"is not a JSON object (got {type(spec).__name__})"
        raise ValueError(f"{label} {what}. {fix}")
    moves = spec.get("moves", [])
    if not isinstance(moves, list):
        raise ValueError(f"{label}: field `moves`={moves!r} must be a list of {{\"rank\", \"to_free_slot\"}}. {fix}")
    for j, m in enumerate(moves):
        if (not isinstance(m, dict) or not _is_int(m.get("rank")) or not _is_int(m.get("to_free_slot"))
                or m["rank"] < 0 or m["to_free_slot"] < 0):
            raise ValueError(f"{label}: field `moves[{j}]`={m!r} must be {{\"rank\": int >= 0, \"to_free_slot\": "
                             f"int >= 0}}. {fix}")
    epoch = spec.get("epoch")
    if epoch is not None and (not _is_int(epoch) or epoch < 0):
        raise ValueError(f"{label}: field `epoch`={epoch!r} must be an int >= 0 or null. {fix}")
    gain = spec.get("predicted_gain")
    if gain is not None and not _is_number(gain):
        raise ValueError(f"{label}: field `predicted_gain`={gain!r} must be a finite number. {fix}")
    checkpoint = spec.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise ValueError(f"{label}: field `checkpoint`={checkpoint!r} must be a file path. {fix}")
    return spec


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: Per-epoch numbers of a history entry the report reads, and its per-rank lists of numbers.
_ENTRY_NUMBERS = ("straggler_level", "idle_fraction", "samples_per_s", "measured_epoch_time", "predicted_epoch_time",
                  "samples", "predicted_gain")
_ENTRY_RANK_LISTS = ("throughput", "gpu_util", "cpu_percent")


def check_history(history: Sequence[Any], label: str) -> None:
    """``ValueError`` naming ``label``, the entry, the field and the value unless every entry of a plan history
    holds what the report reads in the form the balancer writes it (``epoch``: an int >= 0; ``batch_sizes``: ints;
    per-epoch numbers; per-rank lists of numbers; ``plan_changes``; ``relocation``)."""
    fix = ("HINT: a plan history is what BatchBalancer.plan_history (or a sampler's) holds; fix or remove that entry, "
           "or point the report at the run's checkpoint or log folder.")

    def bad(where: str, value: Any, what: str) -> ValueError:
        return ValueError(f"{label}: plan_history{where}={value!r} {what}. {fix}")

    for k, e in enumerate(history):
        if not isinstance(e, Mapping):
            raise bad(f"[{k}]", e, "is not an object")
        epoch = e.get("epoch")
        if not _is_int(epoch) or epoch < 0:
            raise bad(f"[{k}].epoch", epoch, "must be an int >= 0 (each entry names its epoch)")
        sizes = e.get("batch_sizes")
        if sizes is not None and (not isinstance(sizes, list) or not all(_is_int(b) and b >= 0 for b in sizes)):
            raise bad(f"[{k}].batch_sizes", sizes, "must be a list of ints >= 0 (one per rank)")
        for key in _ENTRY_NUMBERS:
            v = e.get(key)
            if v is not None and not _is_number(v):
                raise bad(f"[{k}].{key}", v, "must be a finite number or null")
        for key in _ENTRY_RANK_LISTS:
            v = e.get(key)
            if v is not None and (not isinstance(v, list) or not all(x is None or _is_number(x) for x in v)):
                raise bad(f"[{k}].{key}", v, "must be a list of numbers (one per rank, null where unknown)")
        changes = e.get("plan_changes")
        if changes is not None:
            if not isinstance(changes, list):
                raise bad(f"[{k}].plan_changes", changes, "must be a list of {\"step\", \"batch_sizes\"} objects")
            for j, c in enumerate(changes):
                if (not isinstance(c, Mapping) or not _is_int(c.get("step")) or c["step"] < 0
                        or not isinstance(c.get("batch_sizes"), list)
                        or not all(_is_int(b) and b >= 0 for b in c["batch_sizes"])):
                    raise bad(f"[{k}].plan_changes[{j}]", c, "must be {\"step\": int >= 0, \"batch_sizes\": [ints]}")
        reloc = e.get("relocation")
        if reloc is not None:
            moves = reloc.get("moves") if isinstance(reloc, Mapping) else None
            if (not isinstance(reloc, Mapping) or not isinstance(moves, list)
                    or not all(isinstance(m, list) and len(m) == 2 and all(_is_int(x) for x in m) for m in moves)
                    or (reloc.get("epoch") is not None and not _is_int(reloc["epoch"]))
                    or (reloc.get("predicted_gain") is not None and not _is_number(reloc["predicted_gain"]))):
                raise bad(f"[{k}].relocation", reloc, "must be {\"epoch\": int, \"moves\": [[rank, slot], ...], "
                          "\"predicted_gain\": number, ...} or null")


def _from_file(p: Path, notes: list[str]) -> RunRecord | None:
    if p.suffix in _CHECKPOINT_SUFFIXES:
        return _read_checkpoint(p)
    if p.name.startswith("events.out.tfevents"):
        return _from_scalars(p, "tensorboard", read_tensorboard_scalars([p]))
    if p.suffix == ".csv":
        return _from_scalars(p, "csv", read_csv_scalars(p))
    if p.suffix == ".json":
        data = _read_json(p)
        if isinstance(data, dict) and "moves" in data and "ranks" in data:
            return RunRecord(p, "restart spec", [], restart_spec=data, spec_path=p)
        history = _history_in_json(data)
        return None if history is None else RunRecord(p, "json", history)
    return None


def _from_folder(root: Path, notes: list[str]) -> RunRecord | None:
    """The richest source of the newest run under ``root``: checkpoint, then TensorBoard, CSV, JSON, spec."""
    files = [f for f in root.rglob("*") if f.is_file()]
    newest_first = sorted(files, key=lambda f: f.stat().st_mtime, reverse=True)
    for f in newest_first:
        if f.suffix in _CHECKPOINT_SUFFIXES:
            record = _read_checkpoint(f, quiet=True)
            if record is not None and record.history:
                others = len([g for g in files if g.suffix in _CHECKPOINT_SUFFIXES]) - 1
                if others:
                    notes.append(f"newest of {others + 1} checkpoints under {root}")
                return record
    events = [f for f in newest_first if f.name.startswith("events.out.tfevents")]
    if events:
        folder = events[0].parent
        record = _from_scalars(folder, "tensorboard", read_tensorboard_scalars(
            sorted((f for f in events if f.parent == folder), key=lambda f: f.stat().st_mtime)))
        if record is not None:
            _note_others(notes, root, {f.parent for f in events}, folder)
            return record
    tables = [f for f in newest_first if f.name == "metrics.csv"]
    for table in tables:
        record = _from_scalars(table, "csv", read_csv_scalars(table))
        if record is not None:
            _note_others(notes, root, {f.parent for f in tables}, table.parent)
            return record
    for f in newest_first:
        if f.suffix == ".json" and f.name != SPEC_NAME:
            history = _history_in_json(_read_json(f))
            if history:
                return RunRecord(f, "json", history)
    specs = [f for f in newest_first if f.name == SPEC_NAME]
    if specs:
        return RunRecord(specs[0], "restart spec", [], restart_spec=_read_json(specs[0]), spec_path=specs[0])
    return None


def _note_others(notes: list[str], root: Path, folders: set[Path], chosen: Path) -> None:
    if len(folders) > 1:
        notes.append(f"{len(folders)} logged runs under {root}; reporting the newest, {chosen} "
                     "(point the command at one folder to choose)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _history_in_json(data: Any) -> list[dict[str, Any]] | None:
    """A ``plan_history`` list in a JSON document (top level, or under ``"hetero"`` as in the demo's results)."""
    if isinstance(data, dict):
        for candidate in (data.get("plan_history"), (data.get("hetero") or {}).get("plan_history")
                          if isinstance(data.get("hetero"), dict) else None):
            if isinstance(candidate, list) and candidate and all(isinstance(e, dict) for e in candidate):
                return candidate
    return None


def _read_checkpoint(path: Path, quiet: bool = False) -> RunRecord | None:
    """The balancer's state in a Lightning checkpoint: ``callbacks[<state key>]["planner"]``."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        try:  # checkpoints holding pickled objects (hyper-parameters); the user's own file, as Lightning loads it
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            if quiet:
                return None
            raise ValueError(f"`RUN`={str(path)!r} is not a readable checkpoint ({err}). HINT: give the .ckpt file "
                             "Lightning's ModelCheckpoint wrote, or the run's folder.") from None
    planner = _planner_state(ckpt)
    if planner is None:
        if quiet:
            return None
        raise ValueError(f"the checkpoint {str(path)!r} holds no balancer state (no callback state with a 'planner'). "
                         "HINT: it was written by a run without HeteroDDPStrategy or BatchBalancer; give that "
                         "run's TensorBoard or CSV log folder instead.")
    return RunRecord(path, "checkpoint", list(planner.get("history") or []),
                     world_size=planner.get("world_size"), global_batch=planner.get("global_batch"))


def _planner_state(ckpt: Any) -> dict[str, Any] | None:
    states = ckpt.get("callbacks") if isinstance(ckpt, dict) else None
    if not isinstance(states, dict):
        return None
    ordered = [states["BatchBalancer"]] if "BatchBalancer" in states else []
    ordered += [v for k, v in states.items() if k != "BatchBalancer"]
    for state in ordered:
        if isinstance(state, dict) and isinstance(state.get("planner"), dict) and "history" in state["planner"]:
            return state["planner"]
    return None


def _find_spec(given: Path, source: Path) -> Path | None:
    """``hetero_restart.json`` under the given folder, else beside the source or up to three folders above it."""
    if given.is_dir():
        found = sorted(given.rglob(SPEC_NAME), key=lambda f: f.stat().st_mtime, reverse=True)
        if found:
            return found[0]
    folder = source.parent
    for _ in range(4):
        if (folder / SPEC_NAME).is_file():
            return folder / SPEC_NAME
        if folder.parent == folder:
            break
        folder = folder.parent
    return None


# ---------------------------------------------------------------------------------------------------- logs
def read_csv_scalars(path: str | Path) -> dict[str, list[tuple[int, int | None, float]]]:
    """Every numeric column of a Lightning ``metrics.csv``: ``tag -> [(step, epoch, value), ...]`` in row order."""
    out: dict[str, list[tuple[int, int | None, float]]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            step = _number(row.get("step"))
            epoch = _number(row.get("epoch"))
            for tag, text in row.items():
                value = _number(text)
                if tag in ("step", "epoch") or tag is None or value is None:
                    continue
                out.setdefault(tag, []).append((int(step or 0), None if epoch is None else int(epoch), value))
    return out


def _number(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def read_tensorboard_scalars(paths: Sequence[str | Path]) -> dict[str, list[tuple[int, int | None, float]]]:
    """Every scalar in TensorBoard event files: ``tag -> [(step, epoch, value), ...]``.

    Reads the files directly (TFRecord framing, then the few protobuf fields of ``Event`` and
    ``Summary.Value`` that scalars use: ``simple_value`` or a one-element float/double ``tensor``), so neither
    TensorBoard nor TensorFlow is needed. The epoch of a value is the ``epoch`` scalar Lightning logs at the
    same step (the smallest one where a step holds two).
    """
    raw: dict[str, list[tuple[int, float]]] = {}
    for path in paths:
        for step, tag, value in _scalar_events(Path(path)):
            raw.setdefault(tag, []).append((step, value))
    epochs: dict[int, int] = {}
    for step, value in raw.get("epoch", []):
        epochs[step] = min(epochs.get(step, int(value)), int(value))
    return {tag: [(s, epochs.get(s), v) for s, v in values] for tag, values in raw.items()}


def _scalar_events(path: Path) -> Iterator[tuple[int, str, float]]:
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        start, pos = pos + 12, pos + 12 + length + 4  # length, its CRC, the record, the record's CRC
        if pos > len(data):
            break  # a record still being written
        event = _fields(data[start:start + length])
        step = next((v for f, w, v in event if f == 2 and w == 0), 0)
        for f, w, summary in event:
            if f != 5 or w != 2:
                continue
            for g, x, value in _fields(summary):
                if g == 1 and x == 2:
                    parsed = _scalar_value(value)
                    if parsed is not None:
                        yield int(step), parsed[0], parsed[1]


def _scalar_value(message: bytes) -> tuple[str, float] | None:
    tag, value = None, None
    for f, w, v in _fields(message):
        if f == 1 and w == 2:
            tag = v.decode("utf-8", "replace")
        elif f == 2 and w == 5:  # simple_value
            value = struct.unpack("<f", v)[0]
        elif f == 8 and w == 2:  # TensorProto: float_val (5) or double_val (6), packed or not
            for g, x, t in _fields(v):
                if g == 5 and x == 2 and len(t) >= 4:
                    value = struct.unpack_from("<f", t)[0]
                elif g == 5 and x == 5:
                    value = struct.unpack("<f", t)[0]
                elif g == 6 and x == 2 and len(t) >= 8:
                    value = struct.unpack_from("<d", t)[0]
                elif g == 6 and x == 1:
                    value = struct.unpack("<d", t)[0]
    return None if tag is None or value is None else (tag, float(value))


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """The top-level fields of a protobuf message: ``(number, wire type, value)``; bytes for fixed/length types."""
    out, pos, n = [], 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            break  # groups: not used by event files
        out.append((number, wire, value))
    return out


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(buf):
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return result, pos


#: Per-epoch ``hetero/*`` scalars and the history keys they fill; ``{r}`` is a rank.
_PER_RANK = {"hetero/batch_size/rank_": "batch_sizes", "hetero/throughput/rank_": "throughput",
             "hetero/gpu_util/rank_": "gpu_util", "hetero/cpu_percent/rank_": "cpu_percent"}
_PER_EPOCH = {"hetero/straggler_level": "straggler_level", "hetero/idle_fraction": "idle_fraction",
              "hetero/samples_per_s": "samples_per_s", "hetero/epoch_time": "measured_epoch_time",
              "hetero/predicted_epoch_time": "predicted_epoch_time"}


Scalars = Mapping[str, list[tuple[int, int | None, float]]]


def _from_scalars(source: Path, kind: str, scalars: Scalars) -> RunRecord | None:
    """Per-epoch history entries from logged ``hetero/*`` scalars (``None`` when there are none)."""
    by_epoch: dict[int, dict[str, Any]] = {}
    ranks: dict[str, int] = {}
    for tag, values in scalars.items():
        key, rank = _PER_EPOCH.get(tag), None
        for prefix, name in _PER_RANK.items():
            if tag.startswith(prefix) and tag[len(prefix):].isdigit():
                key, rank = name, int(tag[len(prefix):])
                ranks[name] = max(ranks.get(name, 0), rank + 1)
        if key is None:
            continue
        for k, (_, epoch, value) in enumerate(values):
            e = k if epoch is None else epoch
            entry = by_epoch.setdefault(e, {"epoch": e})
            if rank is None:
                entry[key] = value
            else:
                entry.setdefault(key, {})[rank] = value
    if not by_epoch:
        return None
    history = []
    for e in sorted(by_epoch):
        entry = by_epoch[e]
        for name, n in ranks.items():
            got = entry.get(name, {})
            values = [got.get(r) for r in range(n)]
            entry[name] = ([int(round(v)) for v in values] if name == "batch_sizes" and None not in values
                           else None if name == "batch_sizes" else values)
        history.append(entry)
    lr = [v for _, _, v in scalars.get("hetero/lr_scale", [])]
    return RunRecord(source, kind, history, lr_scale=lr)
