"""``hetero-plugins report``: reading what runs leave behind, the summary, and the picture read back from disk.

Runs of real training are in tests/test_loggers.py (TensorBoard, CSV, checkpoint) and tests/test_examples.py
(the demo's run, as ``make demo`` reports it); here the planner's history comes from a BalancePlanner fed
step times, with what only GPUs and relocations produce added: GPU utilisation, a relocation and its restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero_plugins.apps import report
from hetero_plugins.balancing.planner import BalancePlanner
from tests.helpers.report_png import colored_pixels

ROOT = Path(__file__).resolve().parents[1]


def planner_history(epochs: int = 5) -> tuple[BalancePlanner, list[dict]]:
    """Three ranks at 1, 0.5 and 0.25 of rank 0's speed, 10 steps an epoch, the plan from the step times."""
    p = BalancePlanner(world_size=3, global_batch=96)
    slope = np.array([0.001, 0.002, 0.004])
    for e in range(epochs):
        plan = np.array(p.plan, dtype=float)
        times = 0.002 + slope * plan
        records = np.stack([np.tile([plan[r], times[r], 0.0], (10, 1)) for r in range(3)])
        entry = p.end_epoch(e, records, epoch_time=10 * times.max() + 0.05)
        # As under HeteroDDPStrategy: the first plan comes inside the first epoch, after a few measured steps.
        entry["plan_changes"] = [{"step": 4, "batch_sizes": entry["next_batch_sizes"]}] if e == 0 else []
        entry["gpu_util"] = [90.0 - 5 * r for r in range(3)]
        entry["cpu_percent"] = [20.0, 20.0, 20.0]
        moved = {"epoch": 3, "moves": [[2, 0]], "predicted_gain": 0.2, "saved_seconds": 30.0,
                 "spec": "hetero_restart.json", "checkpoint": "hetero_relocation.ckpt"}
        entry["relocation"] = moved if e == 2 else None
    return p, p.history


def write_checkpoint(path: Path, planner: BalancePlanner) -> Path:
    """A checkpoint as Lightning writes it, the balancer's state under its state key."""
    torch.save({"epoch": 4, "state_dict": {}, "callbacks": {"BatchBalancer": {"planner": planner.state_dict()}}}, path)
    return path


def test_planner_history_gives_every_panel_data_and_the_png_shows_it(tmp_path):
    planner, _ = planner_history()
    ckpt = write_checkpoint(tmp_path / "epoch=4-step=50.ckpt", planner)
    (tmp_path / "hetero_restart.json").write_text(json.dumps({
        "epoch": 3, "predicted_gain": 0.2, "moves": [{"rank": 2, "to_free_slot": 0}], "ranks": [],
        "checkpoint": str(tmp_path / "hetero_relocation.ckpt"), "restart_count": 0}))
    record = report.load_run(tmp_path)
    assert record.kind == "checkpoint" and record.source == ckpt
    assert record.spec_path == tmp_path / "hetero_restart.json"
    assert record.world_size == 3 and record.global_batch == 96 and len(record.history) == 5
    figure = report.render(record, tmp_path / "out" / "report.png")
    assert figure.size == (1600, 900) and figure.path.stat().st_size > 50_000
    assert all(n > 0 for n in figure.panels.values()), figure.panels
    pixels = colored_pixels(figure)
    assert all(pixels[name] > 300 for name in report.PANELS if name != "summary"), pixels
    # Panels hold what they say: 3 ranks' batch sizes with one change inside epoch 0 (and the end of epoch 4),
    # measured and predicted epoch times plus the relocation and the restart.
    assert figure.panels["batch_sizes"] == 3 * (5 + 1 + 1)
    assert figure.panels["epoch_time"] == 5 + 4 + 1 + 1  # no prediction for epoch 0: nothing was measured yet


def test_summary_names_plans_prediction_stragglers_gpus_relocations_and_restarts(tmp_path):
    planner, history = planner_history()
    write_checkpoint(tmp_path / "last.ckpt", planner)
    (tmp_path / "hetero_restart.json").write_text(json.dumps({
        "epoch": 3, "moves": [{"rank": 2, "to_free_slot": 0}], "ranks": [], "checkpoint": "hetero_relocation.ckpt"}))
    text = report.summarize(report.load_run(tmp_path / "last.ckpt"))
    assert f"[32, 32, 32] at epoch 0 -> {history[-1]['batch_sizes']} at epoch 4" in text
    assert "the plan changed 1 time inside epochs and 0 times at epoch ends" in text
    # The time models are exact for these linear step times: the bottleneck ranks run exactly at the predicted
    # pace; rank 0 is a little faster, since integer batches cannot make it finish exactly with the others.
    ratios = [m / p for m, p in zip(history[-1]["throughput"], report.predicted_rates(history[-1]))]
    assert ratios[0] > 1.01 and ratios[1:] == pytest.approx([1.0, 1.0])
    assert "measured / predicted [" + ", ".join(f"{r:.2f}" for r in ratios) + "]" in text
    assert "straggler level (max-min)/mean: 1.25 at epoch 0 -> 0.03 at epoch 4" in text  # (130-34)/76.7 ms
    assert "GPU utilisation per rank, mean %: [90, 85, 80]" in text
    assert "relocation before epoch 3: (rank, free slot) [[2, 0]], predicted 20.0% faster steps" in text
    assert "restart before epoch 3: resumed from hetero_relocation.ckpt" in text


def test_predicted_rates_are_each_ranks_batch_over_the_predicted_step():
    _, history = planner_history()
    last = history[-1]
    step = last["predicted_epoch_time"] / 10
    assert report.predicted_rates(last) == pytest.approx([b / step for b in last["batch_sizes"]])
    assert report.predicted_rates(last) == pytest.approx(last["throughput"], rel=0.04)  # rank 0: 3.6% ahead
    assert report.predicted_rates(history[0]) is None  # no prediction before the first decision


def test_tensorboard_reader_reads_simple_and_tensor_scalars(tmp_path):
    from tensorboardX import SummaryWriter
    from tensorboardX.proto import event_pb2, summary_pb2, tensor_pb2

    w = SummaryWriter(str(tmp_path))
    for step, epoch in ((10, 0), (20, 1)):
        w.add_scalar("epoch", epoch, step)
        w.add_scalar("hetero/batch_size/rank_0", 40 + epoch, step)
        w.add_scalar("hetero/batch_size/rank_1", 24 - epoch, step)
        # TensorBoard's newer scalar form (torch's add_scalar(new_style=True)): a one-element float tensor.
        tensor = tensor_pb2.TensorProto(dtype=1, float_val=[0.5 / (1 + epoch)])
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="hetero/straggler_level", tensor=tensor)])
        w._get_file_writer().add_event(event_pb2.Event(step=step, summary=summary))
    w.close()
    record = report.load_run(tmp_path)
    assert record.kind == "tensorboard"
    assert [e["batch_sizes"] for e in record.history] == [[40, 24], [41, 23]]
    assert [e["straggler_level"] for e in record.history] == pytest.approx([0.5, 0.25])


def test_plan_history_json_and_restart_spec_alone(tmp_path):
    _, history = planner_history(3)
    (tmp_path / "hvd.json").write_text(json.dumps({"mode": "hetero", "plan_history": history}))
    record = report.load_run(tmp_path / "hvd.json")
    assert record.kind == "json" and len(record.history) == 3
    spec = tmp_path / "spec" / "hetero_restart.json"
    spec.parent.mkdir()
    spec.write_text(json.dumps({"epoch": 2, "moves": [{"rank": 1, "to_free_slot": 0}], "ranks": []}))
    only = report.load_run(spec.parent)
    assert only.kind == "restart spec"
    text = report.summarize(only)
    assert "relocation before epoch 2: (rank, free slot) [[1, 0]]" in text and "not applied" in text
    figure = report.render(only, tmp_path / "spec.png")
    assert figure.panels["epoch_time"] == 1 and figure.panels["batch_sizes"] == 0


def test_bad_runs_are_refused_with_what_to_give(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "`RUN`=" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "holds no balancer state" in err and "HINT" in err
    torch.save({"state_dict": {}, "callbacks": {}}, tmp_path / "plain.ckpt")
    assert report.main([str(tmp_path / "plain.ckpt")]) == 2
    assert "holds no balancer state" in capsys.readouterr().err
    planner, _ = planner_history(2)
    write_checkpoint(tmp_path / "ok.ckpt", planner)
    assert report.main([str(tmp_path / "ok.ckpt"), "--out", str(tmp_path / "r.jpg")]) == 2
    assert "must end in .png" in capsys.readouterr().err


def test_command_writes_png_and_summary_beside_the_run(tmp_path):
    planner, _ = planner_history(3)
    run = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    run.mkdir(parents=True)
    write_checkpoint(run / "epoch=2-step=30.ckpt", planner)
    proc = subprocess.run([sys.executable, "-m", "hetero_plugins.cli", "report", str(tmp_path / "lightning_logs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    png, txt = tmp_path / "lightning_logs" / "hetero_report.png", tmp_path / "lightning_logs" / "hetero_report.txt"
    assert f"wrote {png} and {txt}" in proc.stdout
    assert txt.read_text().strip() in proc.stdout and png.stat().st_size > 50_000
