"""The example scripts and the demo, launched as a user launches them: Lightning's own launcher re-runs the
example per rank; the demo runs on a terminal and ends, as ``make demo`` does, with ``hetero-plugins report``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetero_plugins.apps import report
from hetero_plugins.apps.digits import DigitsCNN, digits_datasets
from tests.helpers.report_png import colored_pixels
from tests.helpers.terminal import run_in_terminal

ROOT = Path(__file__).resolve().parents[1]
# The jobs that start ranks are marked distributed (run alone); the argument checks and the README check run in
# `make test`'s parallel pass.


# The strategy with its default aggregation ("weighted") is run by tests/test_lightning_strategy.py (its update
# against one process on the unions); here, the example script as the README runs it, one job per entry point.
@pytest.mark.parametrize(
    "callback, aggregation, where", [
        (True, "weighted", ["--accelerator", "cpu", "--devices", "2", "--speeds", "1,0.25"]),
        (False, "wbsp", []),  # the defaults: --accelerator auto --devices auto --speeds auto (1,0.25 on the CPU)
    ],
    ids=["ddp+BatchBalancer", "hetero_ddp+wbsp"],
)
@pytest.mark.distributed
def test_lightning_example_trains_balances_and_predicts_in_order(tmp_path, callback, aggregation, where):
    out = tmp_path / "out.pt"
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--epochs", "2", "--out", str(out),
           "--cost-per-sample", "0.001", "--aggregation", aggregation, *where] + (["--callback"] if callback else [])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert summary["accelerator"] == ("gpu" if torch.cuda.is_available() and "cpu" not in where else "cpu")
    assert summary["devices"] == 2 and summary["speeds"] == [1.0, 0.25]
    result = torch.load(out, weights_only=False)
    hist = result["plan_history"]
    assert len(hist) == 2 and hist[-1]["batch_sizes"][1] < hist[-1]["batch_sizes"][0]  # rank 1 is 4x slower
    model = DigitsCNN()
    model.load_state_dict(result["state_dict"])
    _, val = digits_datasets()
    with torch.no_grad():
        expected = model(val.tensors[0]).argmax(1)
    preds = result["predictions"]
    if callback:  # stock predict: rank 0 returns its own strided half (Lightning's behaviour, unchanged)
        assert torch.equal(preds, expected[0::2])
    else:  # the strategy balances predict too: contiguous per-rank slices, every rank's outputs in order
        assert torch.equal(preds, expected)
    # The run kept Lightning's log and checkpoint, and the command the example prints reads them.
    log_dir = Path(summary["log_dir"])
    assert f"hetero-plugins report {log_dir}" in proc.stdout
    record = report.load_run(log_dir)
    assert record.kind == "checkpoint"
    assert [e["batch_sizes"] for e in record.history] == [e["batch_sizes"] for e in hist]


def test_example_refuses_speeds_that_do_not_match_the_devices(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--accelerator", "cpu",
                           "--devices", "3", "--speeds", "1,0.25"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--speeds has 2 entries for 3 devices" in proc.stderr and "HINT" in proc.stderr


def test_readme_on_gpus_is_what_the_examples_run():
    """Every code line of the README's "On GPUs" example is in the Lightning example, and every flag its
    commands pass is one the example scripts take."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## On GPUs", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    code = "".join(body for lang, body in blocks if lang == "python")
    commands = "".join(body for lang, body in blocks if lang == "bash")
    example = (ROOT / "examples" / "lightning_train.py").read_text()
    lines = [line.strip() for line in code.splitlines() if line.strip() and line.strip() != "..."]
    assert lines and all(line in example for line in lines), [line for line in lines if line not in example]
    runs = re.findall(r"python (examples/\w+\.py)([^#\n]*)", commands)
    assert {script for script, _ in runs} == {"examples/lightning_train.py", "examples/horovod_train.py"}
    for script, args in runs:
        source = (ROOT / script).read_text()
        assert "--accelerator auto" in args
        for flag in re.findall(r"--[\w-]+", args):
            assert f'"{flag}"' in source, (script, flag)


@pytest.mark.distributed
def test_demo_command_runs_end_to_end(tmp_path):
    """The main job's code path, on a terminal (`make demo` runs the same commands with 4 ranks and 6 epochs):
    the demo with its progress bars and table, then `hetero-plugins report` on the run it kept."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "hetero_plugins.cli", "demo", "--epochs", "2", "--speeds", "1,0.25",
           "--cost-per-sample", "0.001", "--out", str(out)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    rc, screen = run_in_terminal(cmd, cwd=tmp_path, env=env, timeout=300)
    assert rc == 0, screen[-3000:]
    assert "steady epoch time" in screen and "batch sizes per rank" in screen
    assert "final val accuracy (every validation sample once): stock DDP 0." in screen
    assert "ideal for these speeds: 2.50x" in screen  # (1 + 0.25) / (2 x 0.25), not the default speeds' 2.75x
    # Each run draws a bar over its steps, with the rate and the time left (2 epochs of 23 steps).
    for label in ("stock DDP", "hetero"):
        bar = re.escape(label) + r": 100%\|.*\| 46/46 \[[0-9:]+<00:00, +[0-9.]+(step/s|s/step)"
        assert re.search(bar, screen), label
    assert f"hetero-plugins report {out / 'run'}" in screen
    assert (out / "run" / ".hetero_demo_run").is_file()  # marks run/ as the demo's own: a later demo may replace it
    assert (out / "plot.png").stat().st_size > 10_000
    results = json.loads((out / "results.json").read_text())
    assert len(results["ddp"]["epochs"]) == len(results["hetero"]["epochs"]) == 2
    # Both final models scored on the 359 validation samples once each (stock DDP's in-run figure pads to 360).
    assert {round(results[k]["final_val_acc"] * 359, 6) % 1 for k in ("ddp", "hetero")} == {0.0}
    assert results["hetero"]["plan_history"][-1]["batch_sizes"][1] < 16  # the slow rank got less work

    # make demo's last step: the report of the HeteroDDPStrategy run, from its checkpoint.
    png = out / "report.png"
    proc = subprocess.run([sys.executable, "-m", "hetero_plugins.cli", "report", str(out / "run"), "--out", str(png)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {png} and {out / 'report.txt'}" in proc.stdout
    assert "the balancer's state in a checkpoint" in proc.stdout and "[32, 32] at epoch 0" in proc.stdout
    # Read the picture back: the size, and data in every panel (drawn again here to know where the panels are;
    # the same code on the same run draws the same pixels).
    record = report.load_run(out / "run")
    assert [e["batch_sizes"] for e in record.history] == [e["batch_sizes"] for e in results["hetero"]["plan_history"]]
    again = report.render(record, tmp_path / "again.png")
    assert all(n > 0 for n in again.panels.values()), again.panels
    shown = report.Figure(png, again.size, again.panels, again.boxes)
    pixels = colored_pixels(shown)
    assert all(pixels[p] > 300 for p in report.PANELS if p != "summary"), pixels
    import matplotlib.image as mpimg

    assert (mpimg.imread(png) == mpimg.imread(again.path)).all()


def test_cli_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "hetero_plugins.cli", "demo", "--speeds", "1,fast"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--speeds must be comma-separated numbers" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hetero_plugins.cli", "demo", "--speeds", "1,-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--speeds must be positive numbers" in proc.stderr
    for cmd, flag in ((["transfer", "--scenario", "paper_mix", "--from", "nope.npz"], "--from 'nope.npz'"),
                      (["profile-interference", "--from", "nope.json"], "--from 'nope.json'")):
        proc = subprocess.run([sys.executable, "-m", "hetero_plugins.cli", *cmd], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and f"{flag} is not a file. HINT" in proc.stderr, proc.stderr[-2000:]


PREDICT_AFTER_FIT = '''
import sys
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.lightning_jobs import DigitsMLP

pl.seed_everything(0, verbose=False)
t = pl.Trainer(accelerator="cpu", devices=2, strategy=HeteroDDPStrategy(), max_epochs=1, limit_train_batches=12,
               logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, limit_val_batches=0,
               callbacks=[HeterogeneityEmulator([1.0, 0.1], cost_per_sample=0.003)])
model = DigitsMLP(batch_size=16)
t.fit(model)
x, y = digits_datasets(dtype=torch.float64)[1].tensors
out = t.predict(model, dataloaders=DataLoader(TensorDataset(x[:4], y[:4]), batch_size=4))
if t.is_global_zero:
    print("PLAN", t.strategy.batch_plan, "PREDICTED", sum(len(p) for p in out))
'''


@pytest.mark.distributed
def test_predict_after_fit_on_fewer_samples_than_the_plan_shares_gives_every_rank_some(tmp_path):
    """Launched as a user launches a script (Lightning re-runs it per rank, so the fitted plan stays for predict):
    rank 1 (10x slower) holds about 1 in 11 samples, so 4 predict samples shared by speed left it none, and
    Lightning stopped that rank ("DataLoader within local rank has zero length"). The gap is wide so that the
    fitted plan reaches that regime on a loaded machine too (at 4x, a plan of [25, 7] once missed it)."""
    script = tmp_path / "predict_after_fit.py"
    script.write_text(PREDICT_AFTER_FIT)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = [int(b) for b in re.search(r"PLAN \[(\d+), (\d+)\]", proc.stdout).groups()]
    assert plan[1] * 5 <= sum(plan)  # 4 samples by this share (< 0.8): none for rank 1
    assert "PREDICTED 4" in proc.stdout
