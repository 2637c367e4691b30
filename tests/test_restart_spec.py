"""Restart specs: every field checked on read and before a write, resume rules, atomic writes."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest

from hetero_plugins._files import write_atomic
from hetero_plugins.scheduler.relocation import Relocation, Relocator, plan_relocation
from hetero_plugins.scheduler.restart_spec import read_relocation_spec, resume_checkpoint, write_relocation_spec

V100, T4 = (0.005, 0.0005), (0.006, 0.0012)
PLACES = [{"device": "v100", "corunner": None, "host": "a", "index": 0},
          {"device": "t4", "corunner": "video", "host": "a", "index": 1}]
FREE = [{"device": "v100", "corunner": None, "host": "a", "index": 2}]


def _decision() -> Relocation:
    return Relocator(restart_cost=0.0).propose(
        devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"], lines=[V100, T4],
        free_slots=[{"device": "v100"}], global_batch=512, steps_per_epoch=20, epochs_left=5)


def _write(path, **extra):
    with pytest.warns(RuntimeWarning, match="restart spec written"):
        return write_relocation_spec(path, _decision(), PLACES, FREE, epoch=3, extra=extra or None)


def _spec(tmp_path) -> dict:
    return json.loads(_write(tmp_path / "spec.json").read_text())


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(var, raising=False)


def _torchrun(monkeypatch, run: str, count: int) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")


# ---------------------------------------------------------------- reading
def test_a_written_spec_reads_back_and_a_missing_one_is_a_fresh_start(tmp_path):
    path = _write(tmp_path / "spec.json")
    spec = read_relocation_spec(path, world_size=2)
    assert spec == json.loads(path.read_text()) and spec["moves"] == [{"rank": 1, "to_free_slot": 0}]
    assert read_relocation_spec(tmp_path / "missing.json") is None


def test_a_moved_ranks_known_batch_is_written_and_read_back(tmp_path):
    import dataclasses

    decision = dataclasses.replace(_decision(), batches=[None, 48])
    with pytest.warns(RuntimeWarning, match="restart spec written"):
        path = write_relocation_spec(tmp_path / "spec.json", decision, PLACES, FREE, epoch=3)
    ranks = read_relocation_spec(path, world_size=2)["ranks"]
    assert ranks[1]["batch"] == 48 and "batch" not in ranks[0]  # only the moved rank's line stands for a batch


@pytest.mark.parametrize("text, match", [
    ("", r"is empty\. HINT: .*delete the file to start from scratch"),
    ("   \n", r"is empty"),
    ('{"ranks": [{"rank": 0, "dev', r"is not valid JSON .*truncated.*HINT: delete the file"),
    ("[1, 2]", r"is not a JSON object \(got list\)"),
    ('{"ranks": [], "moves": []}', r"field `ranks` is invalid: got \[\]"),
    ('{"moves": [], "predicted_gain": NaN}', r"not valid JSON .*NaN"),
    ("[" * 100000 + "]" * 100000, r"nested too deeply|not valid JSON"),
])
def test_an_unreadable_empty_or_truncated_spec_raises_naming_the_file(tmp_path, text, match):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        read_relocation_spec(path)
    assert str(path) in str(err.value)


def test_a_spec_that_cannot_be_read_raises(tmp_path):
    (tmp_path / "spec.json").mkdir()
    with pytest.raises(ValueError, match=r"exists but cannot be read.*HINT: make it readable, or delete"):
        read_relocation_spec(tmp_path / "spec.json")


@pytest.mark.parametrize("edit, match", [
    # Negative ranks would seed the last rank's model by Python's negative indexing.
    (lambda s: s["ranks"][1].update(rank=-1),
     r"`ranks\[1\]\.rank` is invalid: got -1\. HINT: ranks are ints in \[0, 2\)"),
    (lambda s: s["ranks"][1].update(rank="1"), r"`ranks\[1\]\.rank` is invalid: got '1'"),
    (lambda s: s["ranks"][1].update(rank=1.0), r"`ranks\[1\]\.rank` is invalid: got 1\.0"),
    (lambda s: s["ranks"][1].update(rank=True), r"`ranks\[1\]\.rank` is invalid: got True"),
    (lambda s: s["ranks"][1].update(rank=2), r"`ranks\[1\]\.rank` is invalid: got 2"),
    (lambda s: s["ranks"][1].update(rank=0), r"`ranks\[1\]\.rank` is invalid: got 0\. HINT: each rank has one entry"),
    (lambda s: s["ranks"][1].update(index=-1), r"`ranks\[1\]\.index` is invalid: got -1\. HINT: .*int >= 0"),
    (lambda s: s["ranks"][1].update(index=1.5), r"`ranks\[1\]\.index` is invalid: got 1\.5"),
    (lambda s: s["ranks"][1].update(index="2"), r"`ranks\[1\]\.index` is invalid: got '2'"),
    (lambda s: s["ranks"][0].update(device=None), r"`ranks\[0\]\.device` is invalid: got None"),
    (lambda s: s["ranks"][0].update(corunner=3), r"`ranks\[0\]\.corunner` is invalid: got 3"),
    (lambda s: s["ranks"][0].update(host="a:4\nb"), r"`ranks\[0\]\.host` is invalid"),
    (lambda s: s["ranks"][0].update(line=[0.1]), r"`ranks\[0\]\.line` is invalid: got \[0\.1\]"),
    (lambda s: s["ranks"][0].update(line=["0.1", 0.2]), r"`ranks\[0\]\.line` is invalid"),
    (lambda s: s["ranks"][1].update(batch=0), r"`ranks\[1\]\.batch` is invalid: got 0\. HINT: .*int >= 1"),
    (lambda s: s["ranks"][1].update(batch=12.5), r"`ranks\[1\]\.batch` is invalid: got 12\.5"),
    (lambda s: s["ranks"][0].update({"from": "free_slots[-1]"}), r"`ranks\[0\]\.from` is invalid"),
    (lambda s: s["ranks"].__setitem__(0, "v100"), r"`ranks\[0\]` is invalid: got 'v100'"),
    (lambda s: s.update(ranks={"0": {}}), r"`ranks` is invalid"),
    (lambda s: s.update(moves=[{"rank": -1, "to_free_slot": 0}]), r"`moves\[0\]\.rank` is invalid: got -1"),
    (lambda s: s.update(moves=[{"rank": 1, "to_free_slot": -1}]), r"`moves\[0\]\.to_free_slot` is invalid: got -1"),
    (lambda s: s.update(moves=[{"rank": 1, "to_free_slot": 1}]), r"`moves\[0\]\.to_free_slot` .*disagrees"),
    (lambda s: s.update(moves=[{"rank": 1}]), r"`moves\[0\]` is invalid"),
    (lambda s: s.update(moves="1->0"), r"`moves` is invalid"),
    (lambda s: s.update(epoch=-1), r"`epoch` is invalid: got -1"),
    (lambda s: s.update(predicted_gain="big"), r"`predicted_gain` is invalid: got 'big'"),
    (lambda s: s.update(checkpoint=5), r"`checkpoint` is invalid: got 5"),
    (lambda s: s.update(checkpoint="c.ckpt", run_id=None, restart_count=0), r"`run_id` is invalid: got None"),
    (lambda s: s.update(checkpoint="c.ckpt", run_id="r", restart_count=-1), r"`restart_count` is invalid: got -1"),
    (lambda s: s.update(checkpoint="c.ckpt", run_id="r", restart_count="0"), r"`restart_count` is invalid: got '0'"),
])
def test_every_field_is_checked_on_read(tmp_path, edit, match):
    spec = _spec(tmp_path)
    edit(spec)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=match) as err:
        read_relocation_spec(path)
    assert str(path) in str(err.value) and "HINT" in str(err.value) and "delete the file" in str(err.value)


def test_ranks_must_lie_in_the_reading_jobs_world(tmp_path):
    path = _write(tmp_path / "spec.json")
    assert read_relocation_spec(path, world_size=4) is not None  # a larger job: every rank is one of its
    with pytest.raises(ValueError, match=r"`ranks\[1\]\.rank` is invalid: got 1\. HINT: ranks are ints in \[0, 1\) "
                                         r"for a job of 1 rank"):
        read_relocation_spec(path, world_size=1)


# ---------------------------------------------------------------- writing
def test_the_writer_refuses_what_would_not_read_back_and_writes_nothing(tmp_path):
    path = tmp_path / "spec.json"
    d = _decision()
    bad_index = [{**FREE[0], "index": -1}]
    with pytest.raises(ValueError, match=r"restart spec to write .*`ranks\[1\]\.index` is invalid: got -1.*HINT"):
        write_relocation_spec(path, d, PLACES, bad_index)
    with pytest.raises(ValueError, match=r"`run_id` is invalid"):
        write_relocation_spec(path, d, PLACES, FREE, extra={"checkpoint": "c.ckpt"})
    # A move to a free slot that is not there (a negative index would pick the last one).
    negative = Relocation([None, -1], d.lines, d.current_step_time, d.step_time, d.saved_seconds)
    with pytest.raises(ValueError, match=r"`decision\.targets\[1\]`=-1 names no free slot.*HINT"):
        write_relocation_spec(path, negative, PLACES, FREE)
    with pytest.raises(ValueError, match=r"`decision\.targets\[1\]`=1 names no free slot"):
        write_relocation_spec(path, Relocation([None, 1], d.lines, 1.0, 0.5), PLACES, FREE)
    with pytest.raises(ValueError, match=r"`decision` has 2 ranks but `places` has 1"):
        write_relocation_spec(path, d, PLACES[:1], FREE)
    assert not path.exists() and os.listdir(tmp_path) == []


def test_a_planted_symlink_at_the_old_temporary_name_is_not_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("keep me")
    runs = tmp_path / "runs"
    runs.mkdir()
    path = runs / "hetero_restart.json"
    os.symlink(victim, runs / "hetero_restart.json.tmp")  # the name the writer used to open
    _write(path)
    assert victim.read_text() == "keep me"
    assert read_relocation_spec(path)["moves"] == [{"rank": 1, "to_free_slot": 0}]
    assert os.path.islink(runs / "hetero_restart.json.tmp")  # left as it was, never opened
    assert sorted(os.listdir(runs)) == ["hetero_restart.json", "hetero_restart.json.tmp"]  # no temporary left


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    path = tmp_path / "spec.json"
    os.symlink(victim, path)
    _write(path)
    assert victim.read_text() == "keep me" and not path.is_symlink() and read_relocation_spec(path) is not None


def test_write_atomic_keeps_permissions_and_leaves_nothing_behind_on_failure(tmp_path):
    path = tmp_path / "sub" / "hosts"
    write_atomic(path, "a:1\n")
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_text() == "a:1\n" and stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o640)
    write_atomic(path, b"b:2\n")
    assert path.read_text() == "b:2\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    with pytest.raises(TypeError):
        write_atomic(path, 3)  # type: ignore[arg-type]
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "dir", "x")  # a directory cannot be replaced by a file
    assert sorted(os.listdir(tmp_path / "sub")) == ["hosts"] and os.listdir(tmp_path / "dir") == []
    assert sorted(os.listdir(tmp_path)) == ["dir", "sub"]


# ---------------------------------------------------------------- resuming
def test_resume_returns_the_checkpoint_of_a_later_restart_of_the_same_run(tmp_path, monkeypatch):
    ckpt = tmp_path / "hetero_relocation.ckpt"
    ckpt.write_bytes(b"x")
    path = _write(tmp_path / "spec.json", checkpoint=str(ckpt), run_id="job1", restart_count=0)
    _torchrun(monkeypatch, "job1", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resume_checkpoint(path) == str(ckpt)
        _torchrun(monkeypatch, "job1", 0)
        assert resume_checkpoint(path) is None  # the attempt that wrote it
        _torchrun(monkeypatch, "job1", 2)
        assert resume_checkpoint(path) == str(ckpt)  # a later restart for another reason: the last checkpoint


def test_resume_is_quiet_without_a_spec_or_without_a_checkpoint(tmp_path, monkeypatch, no_torchrun):
    path = _write(tmp_path / "spec.json")  # a spec for a launcher: nothing to resume
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resume_checkpoint(tmp_path / "missing.json") is None
        assert resume_checkpoint(path) is None
        _torchrun(monkeypatch, "job1", 1)
        assert resume_checkpoint(path) is None


def test_resume_refuses_a_spec_naming_a_missing_checkpoint(tmp_path, monkeypatch):
    missing = tmp_path / "gone.ckpt"
    path = _write(tmp_path / "spec.json", checkpoint=str(missing), run_id="job1", restart_count=0)
    _torchrun(monkeypatch, "job1", 1)
    with pytest.raises(ValueError, match=r"spec\.json'.*field `checkpoint` names '.*gone\.ckpt', which does "
                                         r"not exist.*HINT: restore the checkpoint.*or delete the spec"):
        resume_checkpoint(path)


@pytest.mark.parametrize("text", ["", '{"checkpoint": "c.ckpt", "run_id": "job1", "restart_count": 0, "moves": [',
                                  '{"checkpoint": "c.ckpt", "run_id": "job1", "restart_count": "0"}'])
def test_resume_refuses_a_truncated_empty_or_mistyped_spec(tmp_path, monkeypatch, text):
    path = tmp_path / "spec.json"
    path.write_text(text)
    _torchrun(monkeypatch, "job1", 1)
    with pytest.raises(ValueError, match=r"spec\.json.*HINT"):
        resume_checkpoint(path)


def test_a_stale_spec_starts_from_scratch_with_a_warning(tmp_path, monkeypatch, no_torchrun):
    ckpt = tmp_path / "hetero_relocation.ckpt"
    ckpt.write_bytes(b"x")
    path = _write(tmp_path / "spec.json", checkpoint=str(ckpt), run_id="job1", restart_count=1)
    with pytest.warns(RuntimeWarning, match=r"from torchrun run 'job1', attempt 1, but this process was not started "
                                            r"by torchrun: starting from scratch\. HINT: .*ckpt_path="):
        assert resume_checkpoint(path) is None
    _torchrun(monkeypatch, "job2", 3)
    with pytest.warns(RuntimeWarning, match=r"is stale: .*run 'job1', attempt 1, and this is run 'job2', attempt 3"):
        assert resume_checkpoint(path) is None
    _torchrun(monkeypatch, "job1", 0)  # an earlier attempt than the one that wrote it: another run, same id
    with pytest.warns(RuntimeWarning, match=r"is stale"):
        assert resume_checkpoint(path) is None


def test_resuming_under_torchruns_default_run_id_warns(tmp_path, monkeypatch):
    ckpt = tmp_path / "hetero_relocation.ckpt"
    ckpt.write_bytes(b"x")
    path = _write(tmp_path / "spec.json", checkpoint=str(ckpt), run_id="none", restart_count=0)
    _torchrun(monkeypatch, "none", 1)
    with pytest.warns(RuntimeWarning, match=r"default run id 'none'.*HINT: launch torchrun with a unique --rdzv-id"):
        assert resume_checkpoint(path) == str(ckpt)


# ---------------------------------------------------------------- indices elsewhere
def test_plan_relocation_refuses_non_integer_slot_indices():
    slots = [{"device": "t4", "corunner": None}, {"device": "v100", "corunner": None}, {"device": "v100"}]
    times = {"t4": T4, "v100": V100}
    for current in ([0.0, 1.0], [0, 1.5], ["0", "1"], [True, 0], "01"):
        with pytest.raises(ValueError, match=r"`current`=.*must be a list of slot indices \(ints\).*HINT"):
            plan_relocation(None, "training", slots, 2, 64, times, current=current)
    with pytest.raises(ValueError, match=r"`current`=\[-1, 0\] must name 2 distinct slots in \[0, 2\]"):
        plan_relocation(None, "training", slots, 2, 64, times, current=[-1, 0])
    import numpy as np

    assert plan_relocation(None, "training", slots, 2, 64, times, current=np.array([1, 0])).current == [1, 0]


def test_the_relocator_refuses_no_predictor():
    with pytest.raises(ValueError, match=r"`predictor`=False is not usable.*HINT"):
        Relocator(predictor=False)


# ---------------------------------------------------------------- module layout
def test_the_spec_functions_are_still_public_in_relocation_and_the_scheduler():
    import ast
    import inspect

    import hetero_plugins.scheduler as scheduler
    from hetero_plugins.scheduler import relocation, restart_spec

    for name in ("resume_checkpoint", "write_relocation_spec", "read_relocation_spec", "check_relocation_spec",
                 "torchelastic_restarts"):
        assert getattr(relocation, name) is getattr(restart_spec, name), name
        assert name in relocation.__all__ and name in restart_spec.__all__, name
    assert scheduler.resume_checkpoint is restart_spec.resume_checkpoint
    tree = ast.parse(inspect.getsource(restart_spec))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("relocation" in m for m in imported if m), imported  # no cycle back to the relocator


def test_the_scheduler_data_times_is_the_coordinators():
    from hetero_plugins.balancing.coordinator import data_times
    from hetero_plugins.scheduler import cluster_advisor

    assert cluster_advisor.data_times is data_times and "data_times" in cluster_advisor.__all__
