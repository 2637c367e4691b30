"""The hetero/* metrics reach real loggers: a 2-rank run with TensorBoardLogger and CSVLogger, its files read back.

Every documented metric (README, "What you can rely on", and LRAdapter's ``hetero/lr_scale``) is found with the
value of the balancer's own record of the epoch, the plan history that the run's checkpoint holds.
"""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetero_plugins.apps import report
from tests.helpers.report_png import colored_pixels

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
EPOCHS = 3


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """Train once in a fresh process; return the run folder and the checkpoint's plan history."""
    out = tmp_path_factory.mktemp("logged")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "logged_run.py"), str(out), str(EPOCHS)],
                          cwd=out, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log_dir = Path(json.loads(proc.stdout.strip().splitlines()[-1])["log_dir"])
    (ckpt,) = sorted((log_dir / "checkpoints").glob("*.ckpt"))
    history = torch.load(ckpt, weights_only=False)["callbacks"]["BatchBalancer"]["planner"]["history"]
    assert [e["epoch"] for e in history] == list(range(EPOCHS))
    return log_dir, ckpt, history


def _expected(history):
    """The documented per-epoch metrics, by epoch, as the balancer computed them."""
    out = {}
    for e in history:
        metrics = {f"hetero/batch_size/rank_{r}": float(b) for r, b in enumerate(e["batch_sizes"])}
        metrics.update({"hetero/straggler_level": e["straggler_level"], "hetero/idle_fraction": e["idle_fraction"],
                        "hetero/samples_per_s": e["samples_per_s"]})
        out[e["epoch"]] = metrics
    return out


def _tfrecords(path: Path):
    """Independent of the report's reader: TFRecord framing, then tensorboardX's own protobuf Event class."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        yield event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
        pos += 12 + n + 4


def test_tensorboard_event_files_hold_every_documented_metric(logged_run):
    log_dir, _, history = logged_run
    (events,) = log_dir.glob("events.out.tfevents.*")
    scalars: dict[str, list[tuple[int, float]]] = {}
    for ev in _tfrecords(events):
        for v in ev.summary.value:
            if v.WhichOneof("value") == "simple_value":  # scalars (the hparams plugin's entries are not)
                scalars.setdefault(v.tag, []).append((ev.step, v.simple_value))
    epoch_at = {step: int(value) for step, value in scalars["epoch"]}
    for epoch, metrics in _expected(history).items():
        for tag, value in metrics.items():
            logged = [v for step, v in scalars[tag] if epoch_at[step] == epoch]
            assert logged == [pytest.approx(value, rel=1e-6)], (tag, epoch)  # float32 in the event file
    # LRAdapter logs the factor of every (logged) step: 1.0, the global batch never changes under balancing.
    assert len(scalars["hetero/lr_scale"]) >= EPOCHS and {v for _, v in scalars["hetero/lr_scale"]} == {1.0}
    # The report's own reader (no protobuf) reads the same values.
    ours = report.read_tensorboard_scalars([events])
    for tag, values in scalars.items():
        assert [(s, pytest.approx(v)) for s, v in values] == [(s, v) for s, _, v in ours[tag]]


def test_csv_log_holds_every_documented_metric(logged_run):
    log_dir, _, history = logged_run
    with open(log_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for epoch, metrics in _expected(history).items():
        for tag, value in metrics.items():
            logged = [float(r[tag]) for r in rows if r.get(tag) not in (None, "") and int(r["epoch"]) == epoch]
            assert logged == [pytest.approx(value, rel=1e-6)], (tag, epoch)  # self.log keeps float32
    lr = [float(r["hetero/lr_scale"]) for r in rows if r.get("hetero/lr_scale")]
    assert len(lr) >= EPOCHS and set(lr) == {1.0}


def test_the_slow_rank_gets_less_and_the_logs_show_it(logged_run):
    _, _, history = logged_run
    assert history[0]["batch_sizes"] == [32, 32]
    assert history[-1]["batch_sizes"][1] < 20 < history[-1]["batch_sizes"][0]  # rank 1 is 4x slower


@pytest.mark.parametrize("source", ["folder", "checkpoint", "tensorboard", "csv"])
def test_report_reads_each_thing_a_run_leaves(logged_run, tmp_path, source):
    log_dir, ckpt, history = logged_run
    path = {"folder": log_dir, "checkpoint": ckpt, "tensorboard": next(log_dir.glob("events.out.tfevents.*")),
            "csv": log_dir / "metrics.csv"}[source]
    record = report.load_run(path)
    assert record.kind == ("checkpoint" if source == "folder" else source)
    assert [e["batch_sizes"] for e in record.history] == [e["batch_sizes"] for e in history]
    for got, want in zip(record.history, history):
        for key in ("straggler_level", "idle_fraction", "samples_per_s"):
            assert got[key] == pytest.approx(want[key], rel=1e-6)
    assert record.world_size == 2 and record.global_batch == 64
    if source in ("tensorboard", "csv"):
        assert record.lr_scale and set(record.lr_scale) == {1.0}
    figure = report.render(record, tmp_path / "report.png")
    # the logs hold per-rank CPU load (hetero/cpu_percent/rank_i) beside the batch sizes and straggler metrics
    drawn = {"batch_sizes", "throughput", "stragglers", "utilisation", "summary"}
    if source in ("folder", "checkpoint"):  # the checkpoint holds epoch times and predictions too
        drawn |= {"epoch_time"}
    assert {k for k, n in figure.panels.items() if n > 0} == drawn
    pixels = colored_pixels(figure)
    assert all(pixels[p] > 300 for p in drawn - {"summary"}), pixels
