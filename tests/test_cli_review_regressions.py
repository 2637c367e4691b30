"""Regressions of the command-line review: checkpoints that resume only the run that wrote them (and exactly),
output paths and options checked before the work, clean errors (exit 2, naming the flag, the value and the fix)
instead of tracebacks, a cluster file that vanishes mid-rewrite, the demo's run folder, the report's inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from hetero_plugins.cli import main

# the smallest settings the training commands accept that still train something
PLACEMENT = ["--quiet", "--seconds", "120", "--train", "20", "--val", "2", "--episodes", "2", "--fit-steps", "5",
             "--horizon", "1", "--returns", "lines"]
CRITIC = ["--quiet", "--train", "1", "--seeds", "1", "--horizon", "1", "--forks", "1", "--members", "1",
          "--fit-steps", "10"]


def _kill_after_first_checkpoint(command: str, args: list[str], ckpt: Path) -> None:
    """Run ``hetero-plugins command args`` in a fresh interpreter and SIGKILL it as soon as its first
    checkpoint is on disk: a run interrupted for real."""
    proc = subprocess.Popen([sys.executable, "-m", "hetero_plugins.cli", command, *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ckpt.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{command} ended (rc {proc.returncode}) before writing {ckpt}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    assert proc.returncode != 0, f"{command} finished before it could be interrupted"


def _rounds_in(ckpt: Path) -> int:
    with np.load(ckpt, allow_pickle=False) as z:
        return int(json.loads(str(z["meta"]))["rounds"])


def _weights(path: Path) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return [z[k] for k in sorted(z.files) if k != "meta"]


# ---------------------------------------------------------------------------------------------------- checkpoints
def test_pretrain_placement_resumes_only_its_own_run_and_exactly(tmp_path, capsys):
    out = tmp_path / "p.npz"
    ckpt = tmp_path / "p.npz.ckpt.npz"
    _kill_after_first_checkpoint("pretrain-placement", [*PLACEMENT, "--out", str(out), "--rounds", "50"], ckpt)
    done = _rounds_in(ckpt)
    assert done >= 1 and not out.exists()
    rounds = ["--rounds", str(done + 1)]
    before = ckpt.read_bytes()

    # other settings: refused, naming each differing flag with both values and the two ways out
    assert main(["pretrain-placement", *PLACEMENT, "--out", str(out), *rounds, "--train", "21", "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert str(ckpt) in err and "--train 21 (the checkpoint's run: 20)" in err
    assert "--seed 3 (the checkpoint's run: 0)" in err and "--no-resume" in err and "delete" in err
    assert main(["pretrain-placement", *PLACEMENT, "--out", str(out), *rounds, "--init", "shipped"]) == 2
    assert "--init (another starting network" in capsys.readouterr().err
    assert ckpt.read_bytes() == before and not out.exists()  # a refused run touches nothing

    # the same settings: resumed, said so, the checkpoint deleted once the model is written ...
    assert main(["pretrain-placement", *PLACEMENT, "--out", str(out), *rounds]) == 0
    captured = capsys.readouterr()
    assert f"resuming from {ckpt}" in captured.err
    stats = json.loads(captured.out)
    assert stats["resumed"] is True and stats["rounds"] == done + 1 and not ckpt.exists()

    # ... and the model is the one an uninterrupted run gives (samples, random picks and networks restored)
    fresh = tmp_path / "fresh.npz"
    assert main(["pretrain-placement", *PLACEMENT, "--out", str(fresh), *rounds]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["resumed"] is False and whole["samples"] == stats["samples"]
    assert whole["validation"] == stats["validation"]
    assert all(np.array_equal(a, b) for a, b in zip(_weights(out), _weights(fresh), strict=True))


def test_a_corrupt_checkpoint_is_a_clean_error_and_no_resume_starts_over(tmp_path, capsys):
    out = tmp_path / "p.npz"
    ckpt = tmp_path / "p.npz.ckpt.npz"
    ckpt.write_bytes(b"PK\x03\x04 truncated")
    args = ["pretrain-placement", *PLACEMENT, "--out", str(out), "--rounds", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"checkpoint {str(ckpt)!r} cannot be read" in err and "--no-resume" in err and "delete" in err
    assert main([*args, "--no-resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed"] is False
    assert out.is_file() and not ckpt.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave no temp file


def test_pretrain_critic_refuses_another_runs_checkpoint_and_resumes_its_own(tmp_path, capsys):
    out = tmp_path / "c.npz"
    ckpt = tmp_path / "c.npz.ckpt.npz"
    _kill_after_first_checkpoint("pretrain-critic", [*CRITIC, "--out", str(out)], ckpt)
    assert _rounds_in(ckpt) == 1
    assert main(["pretrain-critic", *CRITIC, "--out", str(out), "--horizon", "2", "--family", "shifted"]) == 2
    err = capsys.readouterr().err
    assert "--horizon 2 (the checkpoint's run: 1)" in err and "--family shifted (the checkpoint's run: default)" in err
    assert "--no-resume" in err and ckpt.is_file()
    assert main(["pretrain-critic", *CRITIC, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"resuming from {ckpt}" in captured.err
    stats = json.loads(captured.out)
    assert stats["resumed"] is True and [h["round"] for h in stats["history"]] == [1, 2]
    assert out.is_file() and not ckpt.exists()


def test_a_checkpoint_missing_an_entry_is_a_clean_error(tmp_path, capsys):
    """A checkpoint of this run (same settings) that lacks an array it needs names the file, the entry and the fix,
    and --no-resume starts over."""
    out = tmp_path / "c.npz"
    ckpt = tmp_path / "c.npz.ckpt.npz"
    _kill_after_first_checkpoint("pretrain-critic", [*CRITIC, "--out", str(out)], ckpt)
    with np.load(ckpt, allow_pickle=False) as z:
        kept = {k: z[k] for k in z.files if k != "ys"}
    with open(ckpt, "wb") as f:
        np.savez_compressed(f, **kept)
    args = ["pretrain-critic", *CRITIC, "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(ckpt)!r} is incomplete (KeyError" in err and "'ys'" in err
    assert "--no-resume" in err and "Traceback" not in err and ckpt.is_file()
    assert main([*args, "--no-resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed"] is False and not ckpt.exists()


def test_pretrain_critic_rounds_and_hidden_reach_the_model(tmp_path, capsys):
    """--rounds and --hidden are the API's ``rounds`` and ``hidden``: one round is run, and the networks have the
    widths asked for; a checkpoint of other widths is not resumed."""
    out = tmp_path / "c.npz"
    assert main(["pretrain-critic", *CRITIC, "--rounds", "1", "--hidden", "4,3", "--out", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert [h["round"] for h in stats["history"]] == [1] and stats["rounds"] == 1
    from hetero_plugins.scheduler.rollout_correction import RolloutCorrection

    model = RolloutCorrection.load(out)
    assert model.meta["hidden"] == [4, 3]
    assert [w.shape for w, _ in model.members[0]] == [(18, 4), (4, 3), (3, 1)]
    ckpt = tmp_path / "d.npz.ckpt.npz"
    _kill_after_first_checkpoint("pretrain-critic", [*CRITIC, "--hidden", "4,3", "--out", str(tmp_path / "d.npz")],
                                 ckpt)
    assert main(["pretrain-critic", *CRITIC, "--out", str(tmp_path / "d.npz")]) == 2
    assert "--hidden [32, 32] (the checkpoint's run: [4, 3])" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- paths first
@pytest.mark.parametrize("command, flag", [
    ("pretrain-placement", "--out"), ("pretrain-critic", "--out"), ("transfer", "--out"),
    ("profile-interference", "--out"), ("profile-interference", "--train-ncf"), ("pretrain", "--out"),
    ("bench", "--out"), ("demo", "--out"),
])
def test_a_bad_output_path_fails_before_the_work(tmp_path, capsys, command, flag):
    """At default settings each command works for minutes before writing; the path is refused first."""
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    # folder outputs (pretrain, bench, demo) refuse a file; file outputs refuse a folder and a path under a file
    bad = [str(a_file)] if command in ("pretrain", "bench", "demo") else [str(tmp_path), str(a_file / "m.npz")]
    extra = {"transfer": ["--scenario", "interference"],
             "profile-interference": ["--from", str(tmp_path / "t.json"), "--evaluate"] if flag == "--train-ncf"
             else []}.get(command, [])
    if flag == "--train-ncf":
        (tmp_path / "t.json").write_text("{}")
    for value in bad:
        t0 = time.perf_counter()
        assert main([command, *extra, flag, value]) == 2
        err = capsys.readouterr().err
        assert f"`{flag}`={value!r}" in err and "HINT" in err
        assert time.perf_counter() - t0 < 30
    assert a_file.read_text() == "x"


# ---------------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("argv", [
    ["simulate", "--seed", "-1"], ["simulate", "--allocators", "static", "--seed", "-1"],
    ["pretrain", "--seed", "-1"], ["transfer", "--scenario", "interference", "--seed", "-1"],
    ["pretrain-placement", "--seed", "-1"], ["pretrain-critic", "--seed", "-1"],
    ["profile-interference", "--seed", "-1"],
])
def test_every_command_names_seed_the_same_way(capsys, argv):
    assert main(argv) == 2
    assert "error: `--seed` must be an int >= 0, got -1. HINT: e.g. --seed 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["pretrain-placement", "--rounds", "-1"], "`--rounds` must be >= 1, got -1"),
    (["pretrain-placement", "--rounds", "0"], "`--rounds` must be >= 1, got 0"),
    (["pretrain-placement", "--seconds", "nan"], "`--seconds` must be a finite number > 0, got nan"),
    (["pretrain-placement", "--seconds", "inf"], "`--seconds` must be a finite number > 0, got inf"),
    (["pretrain", "--seconds", "nan"], "`--seconds` must be a finite number > 0, got nan"),
    (["transfer", "--scenario", "interference", "--seconds", "nan"], "`--seconds` must be a finite number > 0"),
    (["simulate", "--allocators", "equal_finish,nosuch"], "`--allocators`='equal_finish,nosuch': 'nosuch' is not"),
    (["simulate", "--allocators", " , "], "`--allocators`=' , ' is empty"),
    (["pretrain-placement", "--init", "missing.npz"], "`--init`='missing.npz' is not a file"),
    (["transfer", "paper_mix", "--scenario", "interference"], "two scenarios given"),
    (["profile-interference", "--batch-scales", "x"], "`--batch-scales`='x' must be comma-separated integers"),
    (["profile-interference", "--intensities", "0"], "`--intensities`='0' must be comma-separated integers"),
    (["pretrain-critic", "--rounds", "0"], "`--rounds` must be >= 1, got 0"),
    (["pretrain-critic", "--hidden", "32,x"], "`--hidden` must be comma-separated layer widths >= 1, got '32,x'"),
    (["pretrain-critic", "--hidden", "0"], "`--hidden` must be comma-separated layer widths >= 1, got '0'"),
])
def test_bad_options_are_usage_errors_naming_the_flag(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "HINT" in err and "Traceback" not in err


def test_init_that_is_not_a_placement_model_is_named(tmp_path, capsys):
    model = tmp_path / "ncf.npz"
    from hetero_plugins.scheduler.ncf import InterferencePredictor

    InterferencePredictor.load().save(model)
    assert main(["pretrain-placement", "--init", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"`--init`={str(model)!r}" in err and "expected 'placement'" in err


def test_profile_from_a_table_with_nothing_to_do_is_refused(tmp_path, capsys):
    table = tmp_path / "t.json"
    from hetero_plugins.scheduler.measured import load_table

    table.write_text(json.dumps(load_table()))
    assert main(["profile-interference", "--from", str(table)]) == 2
    assert "neither --evaluate nor --train-ncf" in capsys.readouterr().err
    model = tmp_path / "ncf.npz"
    assert main(["profile-interference", "--quiet", "--from", str(table), "--train-ncf", str(model)]) == 0
    assert model.is_file()


def test_bench_checks_epochs_and_the_horovod_results_before_running(tmp_path, capsys):
    """Each bench run trains for minutes: these refusals come back at once, or the test would take that long."""
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--epochs", "2"]) == 2
    assert "`--epochs` must be >= 3" in capsys.readouterr().err
    missing = tmp_path / "horovod.json"
    assert main(["bench", "--out", str(out), "--horovod-json", str(missing)]) == 2
    assert f"`--horovod-json`={str(missing)!r} does not exist" in capsys.readouterr().err
    missing.write_text(json.dumps({"speedup": 2.0}))
    assert main(["bench", "--out", str(out), "--horovod-json", str(missing)]) == 2
    assert "field `steady_epoch_time_stock`=None must be a finite number" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------- demo
def test_demo_refuses_a_run_folder_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "run" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("my own run")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "an earlier demo did not write" in err and "--out" in err
    assert mine.read_text() == "my own run"
    other = tmp_path / "other"
    (other / "run").parent.mkdir()
    (other / "run").write_text("a file named run")
    assert main(["demo", "--out", str(other)]) == 2
    assert "an earlier demo did not write" in capsys.readouterr().err
    assert (other / "run").read_text() == "a file named run"


# ---------------------------------------------------------------------------------------------------- cluster file
def test_a_cluster_file_that_vanishes_or_is_not_text_is_a_value_error(tmp_path):
    from hetero_plugins.cluster import read_cluster

    binary = tmp_path / "c.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_cluster(binary, 0, 2)
    with pytest.raises(ValueError, match="does not exist.*atomically"):
        read_cluster(tmp_path / "gone.json", 0, 2)


def test_training_survives_a_manager_that_deletes_and_rewrites_the_cluster_file(tmp_path):
    """A manager that deletes the file before writing it again: every boundary either reads it or warns, and no
    exception reaches the training loop (``FileNotFoundError`` used to, between the check and the read)."""
    from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor

    path = tmp_path / "cluster.json"
    body = json.dumps({"ranks": [{"device": "v100"}, {"device": "t4"}]})
    path.write_text(body)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            path.write_text(body)

    advisor = ClusterAdvisor(str(path), relocation=False)
    advisor.start(0, 2)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    read = skipped = 0
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while time.perf_counter() - t0 < 2.0:
                view = advisor.before_decision(1, 2, allocator=None, data=[0.0, 0.0])
                read, skipped = read + (view is not None), skipped + (view is None)
    finally:
        stop.set()
        thread.join()
    assert read > 0 and read + skipped > 100


# ---------------------------------------------------------------------------------------------------- report
def _history(**first: object) -> dict[str, object]:
    return {"plan_history": [{"epoch": 0, "batch_sizes": [10, 20], **first}, {"epoch": 1, "batch_sizes": [12, 18]}]}


@pytest.mark.parametrize("history, field", [
    ({"plan_history": [{"batch_sizes": [10, 20]}, {"batch_sizes": [12, 18]}]}, "plan_history[0].epoch=None"),
    (_history(batch_sizes="abc"), "plan_history[0].batch_sizes='abc'"),
    (_history(straggler_level="high"), "plan_history[0].straggler_level='high'"),
    (_history(plan_changes=[{"step": 3}]), "plan_history[0].plan_changes[0]"),
    (_history(relocation={"moves": [[0]]}), "plan_history[0].relocation"),
])
def test_report_names_a_bad_plan_history_entry(tmp_path, capsys, history, field):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(history))
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(run) in err and field in err and "HINT" in err


def test_report_names_a_bad_restart_spec_and_reports_a_run_beside_one(tmp_path, capsys):
    spec = tmp_path / "hetero_restart.json"
    spec.write_text(json.dumps({"moves": [{"rank": 0}], "ranks": 2, "epoch": 3}))
    assert main(["report", str(spec), "--out", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert f"restart spec {str(spec)!r}" in err and "`moves[0]`" in err and "HINT" in err
    # the same spec beside a readable run: the run is reported, the summary says why the spec was left out
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_history()))
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    summary = (tmp_path / "r.txt").read_text()
    assert f"note: skipped restart spec {str(spec)!r}" in summary and "relocations: none" in summary


def test_report_draws_a_world_that_shrinks(tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"plan_history": [
        {"epoch": 0, "batch_sizes": [10, 20, 3], "throughput": [1.0, 2.0, 3.0]},
        {"epoch": 1, "batch_sizes": [12, 18], "throughput": [1.0, 2.0]}]}))
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0
