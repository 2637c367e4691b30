"""Relocation by restart as a user meets it: real torchrun / Lightning launches of 2 CPU ranks.

- A worker lost while the relocation checkpoint is being saved: the spec used to be written first, naming a
  checkpoint that never reached the disk, so every later restart stopped with "does not exist" (the job died
  with restarts left). Now the spec is written after the checkpoint, under a name of its own per attempt.
- After a relocation restart the strategy must know its rank's slot before the checkpoint is restored (it
  picks the accelerator ``index`` there): it looked for the spec through ``trainer.ckpt_path``, which Lightning
  sets only later, so a moved rank never ran on its slot.
- A fresh fit (no ``ckpt_path``) in a folder holding another job's spec (4 ranks) used to stop at fit start
  on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.distributed import run_torchrun

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "relocation_review_job.py")


def _run(cmd: list[str], tmp_path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONWARNINGS="ignore")
    return run_torchrun(cmd, tmp_path, env, timeout)


def _other_jobs_spec() -> dict:
    """A spec a 4-rank job left for its launcher (no checkpoint)."""
    return {"epoch": 1, "predicted_gain": 0.3, "current_step_time_s": 0.1, "predicted_step_time_s": 0.07,
            "saved_seconds": 5.0, "moves": [{"rank": 3, "to_free_slot": 0}],
            "ranks": [{"rank": r, "device": "v100", "corunner": None, "from": "own" if r < 3 else "free_slots[0]",
                       "line": [0.0, 0.001]} for r in range(4)]}


def test_a_worker_lost_while_saving_the_relocation_checkpoint_restarts_and_the_moved_rank_finds_its_slot(tmp_path):
    (tmp_path / "hetero_restart.json").write_text(json.dumps(_other_jobs_spec()))  # a fresh fit must ignore it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", SCRIPT, "--out", str(tmp_path), "--die-saving", "--epochs", "2"]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "does not exist" not in proc.stderr and "ranks[2].rank" not in proc.stderr
    # Attempt 0 died saving: it left the old spec in force, so attempt 1 started afresh, relocated after epoch 0
    # and restarted.
    spec = json.loads((tmp_path / "hetero_restart.json").read_text())
    assert spec["restart_count"] == 1 and spec["moves"] == [{"rank": 1, "to_free_slot": 0}]
    assert os.path.isfile(spec["checkpoint"])
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [os.path.basename(spec["checkpoint"])]
    runs = [json.loads((tmp_path / f"attempt2_rank{r}.json").read_text()) for r in (0, 1)]
    for run in runs:
        assert run["resumed"] == spec["checkpoint"] and run["epochs"] == [1] and run["final_epoch"] == 2
    # Before the checkpoint is restored, each rank knows its slot: rank 1 runs on the free v100 at index 0.
    assert runs[0]["relocated_slot"]["from"] == "own"
    assert runs[1]["relocated_slot"]["from"] == "free_slots[0]" and runs[1]["relocated_slot"]["index"] == 0


def test_a_fresh_fit_does_not_read_the_spec(tmp_path, monkeypatch):
    """Without ``ckpt_path`` nothing is resumed: another job's spec (or a broken one) in the folder is not read."""
    import lightning.pytorch as pl

    from hetero_plugins.balancing.options import BalancingOptions
    from hetero_plugins.callbacks._relocation import resumed_relocation

    (tmp_path / "hetero_restart.json").write_text(json.dumps(_other_jobs_spec()))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=str(tmp_path))
    assert trainer.ckpt_path is None
    assert resumed_relocation(BalancingOptions(), trainer) is None
    (tmp_path / "hetero_restart.json").write_text("{half")
    assert resumed_relocation(BalancingOptions(), trainer) is None
    from hetero_plugins.callbacks._relocation import due_relocation

    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(var, raising=False)
    assert due_relocation(BalancingOptions(), trainer) is None  # what the strategy reads before the restore


def test_a_due_spec_of_another_world_size_is_still_refused(tmp_path, monkeypatch):
    """Resuming from a relocation checkpoint whose spec does not fit the job stays an error naming the field."""
    from hetero_plugins.scheduler.restart_spec import due_relocation_spec

    ckpt = tmp_path / "c.ckpt"
    ckpt.write_bytes(b"x")
    spec = {"checkpoint": str(ckpt), "run_id": "job", "restart_count": 0, "moves": [],
            "ranks": [{"rank": r, "device": "v100", "corunner": None, "from": "own", "line": [0.0, 1.0]}
                      for r in range(4)]}
    path = tmp_path / "hetero_restart.json"
    path.write_text(json.dumps(spec))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert due_relocation_spec(path, world_size=2) is None  # the attempt that wrote it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ValueError, match=r"`ranks\[2\]\.rank` is invalid"):
        due_relocation_spec(path, world_size=2)
    assert due_relocation_spec(path, world_size=4)["checkpoint"] == str(ckpt)


def test_a_second_relocation_replaces_the_checkpoint_of_its_own_run_only(tmp_path):
    """The spec is written once its checkpoint exists; the checkpoint it replaces goes when the same run wrote it."""
    from hetero_plugins.callbacks import _relocation

    def spec(run: str, ckpt, count: int) -> dict:
        return {"epoch": 1, "predicted_gain": 0.2, "current_step_time_s": 0.1, "predicted_step_time_s": 0.08,
                "saved_seconds": 1.0, "moves": [{"rank": 1, "to_free_slot": 0}], "checkpoint": str(ckpt),
                "run_id": run, "restart_count": count,
                "ranks": [{"rank": 0, "device": "v100", "corunner": None, "from": "own", "line": [0.0, 1.0]},
                          {"rank": 1, "device": "v100", "corunner": None, "from": "free_slots[0]", "line": [0.0, 1.0]}]}

    path = tmp_path / "hetero_restart.json"
    for other_run, kept in (("another", True), ("job", False)):
        old, new = tmp_path / "hetero_relocation-attempt0-epoch1.ckpt", tmp_path / "hetero_relocation-attempt1-epoch3.ckpt"
        old.write_bytes(b"old")
        new.write_bytes(b"new")
        path.write_text(json.dumps(spec(other_run, old, 0)))
        _relocation._PENDING[str(new)] = {"path": str(path), "spec": spec("job", new, 1)}
        with pytest.warns(RuntimeWarning, match="restart spec written to"):
            assert _relocation._publish_pending(str(new)) is None
        assert json.loads(path.read_text())["checkpoint"] == str(new) and new.is_file()
        assert old.is_file() is kept
    assert _relocation._publish_pending("never-prepared.ckpt") == "no restart spec was prepared on rank 0"


def test_ranks_that_resume_apart_are_named_with_the_fix():
    """After a relocation restart on nodes that do not share the spec's folder, some ranks resume and some start
    from scratch (reproduced with two torchrun agents: they trained epochs 1-2 against 0-2 until one side left)."""
    from hetero_plugins.callbacks._relocation import resume_disagreement

    assert resume_disagreement([True, True], "s.json") is None and resume_disagreement([False, False], "s.json") is None
    problem = resume_disagreement([True, False, True], "/run/hetero_restart.json")
    assert "rank(s) [0, 2] resume" in problem and "rank(s) [1] start from scratch" in problem
    assert "'/run/hetero_restart.json'" in problem and "HINT: put `restart_spec` on a file system" in problem
