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

A plan-history entry or a restart spec given as ``RUN`` that is malformed (an entry without its ``epoch``, batch
sizes that are not ints, a spec field of the wrong type) is refused with exit code 2, naming the file, the entry
and the field; a malformed spec found beside a readable run is left out, and the summary says why.

The picture has six panels: batch size per rank over epochs (with plan changes inside epochs), each rank's
measured throughput against the plan's prediction, measured against predicted epoch time with relocations and
restarts marked, straggler level and idle fraction, GPU utilisation per rank (CPU load where no GPU was
measured), and the text summary. A panel whose data the source does not hold says so instead of plotting.
The straggler level and the idle fraction are those of LBB (Yao et al., J. Supercomputing 2024); the plan's
prediction is that of the per-rank linear time models t_i(b) = a_i + beta_i b (LBB; LB-BSP, Chen et al. 2018).
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero_plugins.apps.run_logs import RunRecord, load_run, read_csv_scalars, read_tensorboard_scalars

__all__ = ["Figure", "RunRecord", "load_run", "main", "read_csv_scalars", "read_tensorboard_scalars", "render",
           "summarize"]

#: Panels of the picture, in reading order (left to right, top to bottom).
PANELS = ("batch_sizes", "throughput", "epoch_time", "stragglers", "utilisation", "summary")


@dataclass
class Figure:
    """The written picture: its path, size in pixels, the data points drawn in each panel (0: the panel shows
    a note instead of data) and each panel's box in the PNG's pixels (left, top, right, bottom)."""

    path: Path
    size: tuple[int, int]
    panels: dict[str, int]
    boxes: dict[str, tuple[int, int, int, int]]


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
    for key, label in (("gpu_util", "GPU utilisation per rank, mean %"),
                       ("cpu_percent", "CPU load of each rank's machine (all its processes), mean %")):
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
    n, drawn = max(len(e["batch_sizes"]) for e in rows), 0  # the world may grow or shrink (elastic runs)
    for r in range(n):
        c = colors[r % len(colors)]
        xs, ys, changes = [], [], []
        mine = [e for e in rows if r < len(e["batch_sizes"])]
        for e in mine:
            xs.append(e["epoch"])
            ys.append(e["batch_sizes"][r])
            steps = _steps(e)
            for change in (e.get("plan_changes") or []) if steps else []:
                if r < len(change["batch_sizes"]):
                    xs.append(e["epoch"] + min(change["step"] / steps, 0.999))
                    ys.append(change["batch_sizes"][r])
                    changes.append((xs[-1], ys[-1]))
        xs.append(mine[-1]["epoch"] + 1)
        ys.append(ys[-1])
        ax.plot(xs, ys, drawstyle="steps-post", color=c, lw=1.8, label=f"rank {r}" if n <= 16 else None)
        ax.plot([e["epoch"] for e in mine], [e["batch_sizes"][r] for e in mine], "o", color=c, ms=4)
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
    n, drawn = max(len(e["throughput"]) for e in rows), 0  # the world may grow or shrink (elastic runs)
    for r in range(n):
        c = colors[r % len(colors)]
        pts = [(e["epoch"], e["throughput"][r]) for e in rows if r < len(e["throughput"])
               and e["throughput"][r] is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color=c, lw=1.5, label=f"rank {r}" if n <= 16 else None)
        pred = [(e["epoch"], p[r]) for e in rows if (p := predicted_rates(e)) is not None and r < len(p)]
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
                       ("cpu_percent", "CPU load of each rank's machine (no GPU measured)")):
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
