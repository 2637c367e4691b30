"""``hetero-plugins report RUN``: what the balancer did in a run, as one PNG and a short text summary.

``RUN`` is what a run leaves behind, or a folder that holds it (``lightning_logs/version_0``, a
``default_root_dir``; the newest run inside is taken):

- a Lightning checkpoint (``*.ckpt``): the balancer's state (``BatchBalancer`` -> ``planner``) holds every
  epoch's plan, the plan changes inside epochs, each rank's measured throughput, the plan's predicted
  epoch time, the straggler level, the idle fraction, CPU load and GPU utilisation per rank, and relocations;
- a TensorBoard event file or a ``metrics.csv`` of Lightning's ``CSVLogger``: the ``hetero/*`` metrics
  logged every epoch (batch size per rank, straggler level, idle fraction, samples/s);
- a JSON file with a ``plan_history`` (the Horovod example's ``--json-out``, the demo's ``results.json``);
- a restart spec (``hetero_restart.json``), which is also read when it lies beside or above any of the above:
  relocations and the restarts that applied them.

The picture has six panels: batch size per rank over epochs (with plan changes inside epochs), each rank's
measured throughput against the plan's prediction, measured against predicted epoch time with relocations and
restarts marked, straggler level and idle fraction, GPU utilisation per rank (CPU load where no GPU was
measured), and the text summary. A panel whose data the source does not hold says so instead of plotting.
The straggler level and the idle fraction are those of LBB (Yao et al., J. Supercomputing 2024); the plan's
prediction is that of the per-rank linear time models t_i(b) = a_i + beta_i b (LBB; LB-BSP, Chen et al. 2018).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import struct
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Figure", "RunRecord", "load_run", "main", "read_csv_scalars", "read_tensorboard_scalars", "render",
           "summarize"]

#: Panels of the picture, in reading order (left to right, top to bottom).
PANELS = ("batch_sizes", "throughput", "epoch_time", "stragglers", "utilisation", "summary")
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


@dataclass
class Figure:
    """The written picture: its path, size in pixels, the data points drawn in each panel (0: the panel shows
    a note instead of data) and each panel's box in the PNG's pixels (left, top, right, bottom)."""

    path: Path
    size: tuple[int, int]
    panels: dict[str, int]
    boxes: dict[str, tuple[int, int, int, int]]


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
    if record.kind != "restart spec" and record.restart_spec is None:
        spec_path = _find_spec(p, record.source)
        if spec_path is not None:
            record.restart_spec, record.spec_path = _read_json(spec_path), spec_path
    if record.world_size is None:
        sizes = [e.get("batch_sizes") for e in record.history if e.get("batch_sizes")]
        if sizes:
            record.world_size, record.global_batch = len(sizes[0]), int(sum(sizes[0]))
    return record


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


# ---------------------------------------------------------------------------------------------------- derived
def _steps(entry: Mapping[str, Any]) -> int | None:
    sizes, samples = entry.get("batch_sizes"), entry.get("samples")
    if not sizes or not samples:
        return None
    return max(1, math.ceil(samples / sum(sizes)))


def _end_plan(entry: Mapping[str, Any]) -> list[int] | None:
    changes = entry.get("plan_changes") or []
    return list(changes[-1]["batch_sizes"]) if changes else entry.get("batch_sizes")


def predicted_rates(entry: Mapping[str, Any]) -> list[float] | None:
    """Each rank's throughput as the plan predicts it for the epoch: its batch over the predicted step time.

    The planner predicts one step time for the plan in force (the slowest rank's, from the time models); under
    an equal-finish plan every rank is predicted to finish its batch in it.
    """
    plan, steps, predicted = _end_plan(entry), _steps(entry), entry.get("predicted_epoch_time")
    if not plan or not steps or not predicted:
        return None
    step = predicted / steps
    return [b / step for b in plan] if step > 0 else None


def relocations(record: RunRecord) -> list[dict[str, Any]]:
    """Relocations from the history (``relocation`` entries), else from the restart spec."""
    found = [dict(e["relocation"]) for e in record.history if isinstance(e.get("relocation"), dict)]
    spec = record.restart_spec
    if not found and isinstance(spec, dict) and spec.get("moves"):
        found.append({"epoch": spec.get("epoch"), "moves": [[m["rank"], m["to_free_slot"]] for m in spec["moves"]],
                      "predicted_gain": spec.get("predicted_gain"), "spec": str(record.spec_path),
                      "checkpoint": spec.get("checkpoint")})
    return found


def restarts(record: RunRecord) -> list[dict[str, Any]]:
    """Restarts that applied a relocation: a relocation record, or the restart spec, that names the checkpoint
    every rank saved before torchrun restarted them (only applied relocations have one)."""
    found = [{"epoch": m.get("epoch"), "checkpoint": m["checkpoint"]}
             for m in relocations(record) if m.get("checkpoint")]
    spec = record.restart_spec
    if not found and isinstance(spec, dict) and spec.get("checkpoint"):
        found.append({"epoch": spec.get("epoch"), "checkpoint": spec["checkpoint"]})
    return found


# ---------------------------------------------------------------------------------------------------- summary
def _fmt(values: Sequence[Any] | None, digits: int = 0) -> str:
    if not values:
        return "-"
    return "[" + ", ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + "]"


def _first_last(history: Sequence[Mapping[str, Any]], key: str) -> tuple[Any, Any, Any, Any] | None:
    rows = [(e["epoch"], e[key]) for e in history if e.get(key) is not None]
    return None if not rows else (rows[0][0], rows[0][1], rows[-1][0], rows[-1][1])


def summarize(record: RunRecord) -> str:
    """A short text summary of the run: plans, throughput against prediction, stragglers, utilisation, moves."""
    h = record.history
    kinds = {"checkpoint": "the balancer's state in a checkpoint",
             "tensorboard": "hetero/* metrics of a TensorBoard log", "csv": "hetero/* metrics of a CSV log",
             "json": "a plan history", "restart spec": "a restart spec"}
    lines = [f"run: {record.source} ({kinds.get(record.kind, record.kind)})"]
    if h:
        span = f"{len(h)} epoch{'s' if len(h) != 1 else ''} ({h[0]['epoch']}..{h[-1]['epoch']})"
        who = f"{record.world_size} ranks, global batch {record.global_batch}, " if record.world_size else ""
        steps = _steps(h[-1])
        lines.append(f"{who}{span}" + (f", {steps} steps per epoch" if steps else ""))
    fl = _first_last(h, "batch_sizes")
    if fl:
        ends = sum(1 for a, b in zip(h, h[1:]) if a.get("batch_sizes") and b.get("batch_sizes")
                   and b["batch_sizes"] != _end_plan(a))
        inside = sum(len(e.get("plan_changes") or []) for e in h)
        text = f"batch size per rank: {fl[1]} at epoch {fl[0]} -> {fl[3]} at epoch {fl[2]}; "
        if any("plan_changes" in e for e in h):
            text += (f"the plan changed {inside} time{'s' if inside != 1 else ''} inside epochs and {ends} "
                     f"time{'s' if ends != 1 else ''} at epoch ends")
        else:
            text += (f"the plan an epoch started with changed {ends} time{'s' if ends != 1 else ''} (changes inside "
                     "epochs are in the run's checkpoint)")
        lines.append(text)
    last = next((e for e in reversed(h) if e.get("throughput")), None)
    if last is not None:
        predicted = predicted_rates(last)
        text = f"throughput per rank, samples/s of compute, epoch {last['epoch']}: measured {_fmt(last['throughput'])}"
        if predicted:
            ratios = [m / p if m and p else None for m, p in zip(last["throughput"], predicted)]
            text += f", plan's prediction {_fmt(predicted)}, measured / predicted {_fmt(ratios, 2)}"
        lines.append(text)
    for key, label, digits in (("straggler_level", "straggler level (max-min)/mean", 2),
                               ("idle_fraction", "idle fraction at the barrier", 2),
                               ("samples_per_s", "training samples/s", 0)):
        fl = _first_last(h, key)
        if fl:
            lines.append(f"{label}: {fl[1]:.{digits}f} at epoch {fl[0]} -> {fl[3]:.{digits}f} at epoch {fl[2]}")
    lines.append(_utilisation_line(h))
    if record.lr_scale:
        lines.append(f"learning-rate scale (LRAdapter): {record.lr_scale[0]:.3g} -> {record.lr_scale[-1]:.3g}")
    moves = relocations(record)
    if moves:
        for m in moves:
            gain = m.get("predicted_gain")
            lines.append(f"relocation before epoch {m.get('epoch')}: (rank, free slot) {m.get('moves')}"
                         + (f", predicted {100 * gain:.1f}% faster steps" if gain is not None else "")
                         + (f"; spec {m['spec']}" if m.get("spec") else ""))
    else:
        lines.append("relocations: none")
    done = restarts(record)
    if done:
        for r in done:
            lines.append(f"restart before epoch {r['epoch']}: resumed from {r['checkpoint']}")
    elif moves:
        lines.append("restarts: none (the relocation was written as a restart spec, not applied)")
    else:
        lines.append("restarts: none")
    lines += [f"note: {n}" for n in record.notes]
    return "\n".join(lines)


def _utilisation_line(history: Sequence[Mapping[str, Any]]) -> str:
    for key, label in (("gpu_util", "GPU utilisation per rank, mean %"), ("cpu_percent", "CPU load per rank, mean %")):
        series = _per_rank_series(history, key)
        if series:
            measured = [[v for v in values if v is not None] for values in series]
            means = [sum(v) / len(v) if v else None for v in measured]
            prefix = "" if key == "gpu_util" else "no GPU measured; "
            return f"{prefix}{label}: {_fmt(means)}"
    return "GPU utilisation: not recorded in this source"


def _per_rank_series(history: Sequence[Mapping[str, Any]], key: str) -> list[list[float | None]] | None:
    rows = [e.get(key) for e in history]
    if not any(r and any(v is not None for v in r) for r in rows):
        return None
    n = max(len(r) for r in rows if r)
    return [[(r[i] if r and i < len(r) else None) for r in rows] for i in range(n)]


# ---------------------------------------------------------------------------------------------------- picture
def render(record: RunRecord, path: str | Path, summary: str | None = None, dpi: int = 100) -> Figure:
    """Draw the six panels of ``record`` into the PNG ``path``; return what was drawn where."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = summarize(record) if summary is None else summary
    h = record.history
    fig, axes = plt.subplots(2, 3, figsize=(16, 9), dpi=dpi)
    ax = dict(zip(PANELS, axes.flat))
    n_ranks = record.world_size or max((len(e.get("batch_sizes") or []) for e in h), default=0)
    colors = [plt.get_cmap("tab10" if n_ranks <= 10 else "tab20")(r % 20) for r in range(max(n_ranks, 1))]
    points = {
        "batch_sizes": _draw_batch_sizes(ax["batch_sizes"], h, colors),
        "throughput": _draw_throughput(ax["throughput"], h, colors),
        "epoch_time": _draw_epoch_time(ax["epoch_time"], record),
        "stragglers": _draw_stragglers(ax["stragglers"], h),
        "utilisation": _draw_utilisation(ax["utilisation"], h, colors),
    }
    s = ax["summary"]
    s.axis("off")
    s.set_title("summary", loc="left", fontsize=11)
    wrapped = "\n".join(textwrap.fill(line, 64, subsequent_indent="  ") for line in summary.splitlines())
    s.text(0.0, 1.0, wrapped, family="monospace", fontsize=7.6, va="top", ha="left", transform=s.transAxes)
    points["summary"] = len(summary.splitlines())
    for name in PANELS[:-1]:
        a = ax[name]
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        if h:
            a.set_xlabel("epoch")
            a.set_xlim(min(e["epoch"] for e in h) - 0.1, max(e["epoch"] for e in h) + 1.1 if name == "batch_sizes"
                       else max(e["epoch"] for e in h) + 0.1)
        a.grid(alpha=0.3)
    fig.suptitle(f"hetero-plugins report: {record.source}", fontsize=12, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    width, height = (int(round(v)) for v in fig.get_size_inches() * dpi)
    fig.canvas.draw()
    boxes = {}
    for name, a in ax.items():
        b = a.get_window_extent()
        boxes[name] = (int(b.x0), int(height - b.y1), int(math.ceil(b.x1)), int(math.ceil(height - b.y0)))
    plt.close(fig)
    return Figure(path, (width, height), points, boxes)


def _note(ax: Any, text: str) -> int:
    ax.text(0.5, 0.5, text, ha="center", va="center", color="0.4", fontsize=9, wrap=True, transform=ax.transAxes)
    return 0


def _legend(ax: Any, n: int, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=1 if n <= 6 else 2, **kw)


def _draw_batch_sizes(ax: Any, h: Sequence[Mapping[str, Any]], colors: list[Any]) -> int:
    ax.set_title("batch size per rank (x: plan changes inside an epoch)", loc="left", fontsize=11)
    ax.set_ylabel("local batch size")
    rows = [e for e in h if e.get("batch_sizes")]
    if not rows:
        return _note(ax, "no per-rank batch sizes in this source\n(a stock DDP run with StragglerMonitor?)")
    n, drawn = len(rows[0]["batch_sizes"]), 0
    for r in range(n):
        c = colors[r % len(colors)]
        xs, ys, changes = [], [], []
        for e in rows:
            xs.append(e["epoch"])
            ys.append(e["batch_sizes"][r])
            steps = _steps(e)
            for change in (e.get("plan_changes") or []) if steps else []:
                xs.append(e["epoch"] + min(change["step"] / steps, 0.999))
                ys.append(change["batch_sizes"][r])
                changes.append((xs[-1], ys[-1]))
        xs.append(rows[-1]["epoch"] + 1)
        ys.append(ys[-1])
        ax.plot(xs, ys, drawstyle="steps-post", color=c, lw=1.8, label=f"rank {r}" if n <= 16 else None)
        ax.plot([e["epoch"] for e in rows], [e["batch_sizes"][r] for e in rows], "o", color=c, ms=4)
        if changes:
            ax.plot(*zip(*changes), "x", color=c, ms=7, mew=1.5)
        drawn += len(xs)
    ax.set_ylim(bottom=0)
    _legend(ax, n)
    return drawn


def _draw_throughput(ax: Any, h: Sequence[Mapping[str, Any]], colors: list[Any]) -> int:
    rows = [e for e in h if e.get("throughput")]
    ax.set_ylabel("samples/s")
    if not rows:
        rows = [e for e in h if e.get("samples_per_s") is not None]
        ax.set_title("throughput, all ranks", loc="left", fontsize=11)
        if not rows:
            return _note(ax, "no throughput in this source")
        ax.plot([e["epoch"] for e in rows], [e["samples_per_s"] for e in rows], "o-", color="tab:blue",
                label="measured (training samples/s)")
        ax.text(0.02, 0.03, "per-rank rates and the plan's prediction\nare in the run's checkpoint",
                transform=ax.transAxes, fontsize=8, color="0.4")
        ax.set_ylim(bottom=0)
        _legend(ax, 1, loc="lower right")
        return len(rows)
    ax.set_title("throughput per rank: measured (o), plan's prediction (--)", loc="left", fontsize=11)
    ax.text(0.02, 0.03, "prediction: batch / predicted step time", transform=ax.transAxes, fontsize=8, color="0.4")
    n, drawn = len(rows[0]["throughput"]), 0
    for r in range(n):
        c = colors[r % len(colors)]
        pts = [(e["epoch"], e["throughput"][r]) for e in rows if e["throughput"][r] is not None]
        ax.plot(*zip(*pts), "o-", color=c, lw=1.5, label=f"rank {r}" if n <= 16 else None)
        pred = [(e["epoch"], p[r]) for e in rows if (p := predicted_rates(e)) is not None]
        if pred:
            ax.plot(*zip(*pred), "--", color=c, lw=1.2)
        drawn += len(pts) + len(pred)
    ax.set_ylim(bottom=0)
    _legend(ax, n)
    return drawn


def _draw_epoch_time(ax: Any, record: RunRecord) -> int:
    h = record.history
    ax.set_title("epoch time; relocations and restarts", loc="left", fontsize=11)
    ax.set_ylabel("seconds")
    measured = [(e["epoch"], e["measured_epoch_time"]) for e in h if e.get("measured_epoch_time") is not None]
    predicted = [(e["epoch"], e["predicted_epoch_time"]) for e in h if e.get("predicted_epoch_time") is not None]
    drawn = 0
    if measured:
        ax.plot(*zip(*measured), "o-", color="tab:blue", label="measured (training)")
        drawn += len(measured)
    if predicted:
        ax.plot(*zip(*predicted), "s--", color="tab:orange", label="predicted by the plan (compute)")
        drawn += len(predicted)
    # Between the epochs they separate: a dashed line for a relocation written as a spec, a solid red one for a
    # restart that applied it.
    marks: dict[float, list[str]] = {}
    for m in relocations(record):
        if m.get("epoch") is not None:
            moves = ", ".join(f"{r}->slot {k}" for r, k in m.get("moves") or [])
            marks.setdefault(m["epoch"] - 0.5, []).append(f"relocation: rank {moves}")
    restarted = {r["epoch"] - 0.5 for r in restarts(record) if r.get("epoch") is not None}
    for x in restarted:
        marks.setdefault(x, []).append("restart")
    for x, labels in sorted(marks.items()):
        color = "tab:red" if x in restarted else "tab:purple"
        ax.axvline(x, color=color, ls="-" if x in restarted else "--", lw=1.8)
        ax.annotate(" + ".join(labels), (x, 0.5), xycoords=("data", "axes fraction"), rotation=90, va="center",
                    ha="center", fontsize=8, color=color, bbox={"fc": "white", "ec": "none", "alpha": 0.85})
        drawn += len(labels)
    if not drawn:
        text = "no epoch times in this source"
        if record.kind in ("tensorboard", "csv"):
            text += "\n(they are in the run's checkpoint)"
        return _note(ax, text)
    if not relocations(record) and not restarts(record):
        ax.text(0.98, 0.03, "no relocations or restarts", transform=ax.transAxes, ha="right", fontsize=8, color="0.4")
    ax.set_ylim(bottom=0)
    _legend(ax, 2, loc="upper right")
    return drawn


def _draw_stragglers(ax: Any, h: Sequence[Mapping[str, Any]]) -> int:
    ax.set_title("straggler level and idle fraction", loc="left", fontsize=11)
    drawn = 0
    for key, label, style, color in (("straggler_level", "straggler level (max-min)/mean", "o-", "tab:red"),
                                     ("idle_fraction", "idle fraction at the barrier", "s-", "tab:gray")):
        pts = [(e["epoch"], e[key]) for e in h if e.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=label)
            drawn += len(pts)
    if not drawn:
        return _note(ax, "no straggler metrics in this source")
    ax.set_ylim(bottom=0)
    _legend(ax, 2, loc="upper right")
    return drawn


def _draw_utilisation(ax: Any, h: Sequence[Mapping[str, Any]], colors: list[Any]) -> int:
    ax.set_ylabel("%")
    for key, title in (("gpu_util", "GPU utilisation per rank"),
                       ("cpu_percent", "CPU load per rank (no GPU measured)")):
        series = _per_rank_series(h, key)
        if not series:
            continue
        ax.set_title(title, loc="left", fontsize=11)
        drawn = 0
        for r, values in enumerate(series):
            pts = [(e["epoch"], v) for e, v in zip(h, values) if v is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", color=colors[r % len(colors)],
                        label=f"rank {r}" if len(series) <= 16 else None)
                drawn += len(pts)
        ax.set_ylim(0, 105)
        _legend(ax, len(series))
        if len(series) > 1 and all(a is None and b is None or a is not None and b is not None and abs(a - b) < 1.0
                                   for values in series for a, b in zip(values, series[0])):
            ax.text(0.02, 0.03, "the ranks' lines coincide (ranks on one machine read its load)",
                    transform=ax.transAxes, fontsize=8, color="0.4")
        return drawn
    ax.set_title("GPU utilisation per rank", loc="left", fontsize=11)
    return _note(ax, "no utilisation in this source\n(the checkpoint holds GPU and CPU load per rank)")


# ---------------------------------------------------------------------------------------------------- command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetero-plugins report",
        description="A picture and a short summary of what the balancer did in a run.",
        epilog="RUN: a checkpoint (.ckpt), a TensorBoard or CSV log folder (lightning_logs/version_0), a metrics.csv, "
               "a JSON with a plan_history, a hetero_restart.json, or a folder holding them (the newest run is taken).")
    parser.add_argument("run", metavar="RUN", help="what the run left behind (see below)")
    parser.add_argument("--out", default=None,
                        help="PNG to write (default: hetero_report.png in RUN's folder); the summary goes beside it "
                             "with the suffix .txt")
    args = parser.parse_args(argv)
    try:
        record = load_run(args.run)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out is None:
        folder = Path(args.run) if Path(args.run).is_dir() else Path(args.run).parent
        out = folder / "hetero_report.png"
    else:
        out = Path(args.out)
        if out.suffix.lower() != ".png":
            print(f"error: `--out`={args.out!r} must end in .png. HINT: e.g. --out report.png", file=sys.stderr)
            return 2
    summary = summarize(record)
    render(record, out, summary)
    text = out.with_suffix(".txt")
    text.write_text(summary + "\n")
    print(summary)
    print(f"wrote {out} and {text}")
    return 0
