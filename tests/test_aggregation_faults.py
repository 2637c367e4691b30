"""Faults under HeteroDDPStrategy: a rank that freezes, and a foreign client that writes to the claim store.

- A rank stops (``SIGSTOP``) mid-epoch: the other rank must end within the strategy's ``timeout`` (plus start-up
  slack) with an error naming the frozen rank and the operation it gave up on (``wbsp`` waits on the claim
  store, ``weighted`` in DDP's gradient all-reduce). Both ranks are real processes launched the way Lightning's
  manual launch expects (``LOCAL_RANK`` ...), so the test knows, stops and kills each of them. With three ranks
  (``TorchCollectives`` alone), the survivors name the frozen one from the heartbeats, or rank 0 when the store
  it serves stops answering.
- A client outside the job that reaches the claim store must not make a ``wbsp`` step lose or repeat samples
  silently: claims written under the old, predictable key scheme change nothing (every sample is still
  processed exactly once per epoch), and claims written under the job's own keys (read from ``list_keys``)
  end the run with a :class:`~hetero_plugins.aggregation.wbsp.ClaimError`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import lightning.pytorch as pl

from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.aggregation.wbsp import ClaimError
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.helpers.distributed import START_METHOD
from tests.lightning_jobs import IndexedDigitsMLP, Report, read_reports
from tests.test_aggregation_core import FixedTimes, run_engine

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "frozen_rank.py"
REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 6.0  # the strategy's timeout in the frozen-rank jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["wbsp", "weighted"])
def test_a_frozen_rank_0_ends_the_job_with_an_error_naming_it(tmp_path, mode):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), "--mode", mode, "--timeout", str(TIMEOUT), "--out", str(tmp_path),
             "--freeze-rank", "0"], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True))
    try:
        out, _ = procs[1].communicate(timeout=TIMEOUT + 100)
    except subprocess.TimeoutExpired:
        _kill(procs[1])
        pytest.fail(f"rank 1 still ran {TIMEOUT + 100:g} s after the start with rank 0 frozen")
    finally:
        for p in procs:
            _kill(p)
    frozen = tmp_path / "frozen"
    assert frozen.exists(), out[-4000:]
    after = time.time() - float(frozen.read_text())
    print(f"\n{mode}: rank 1 ended {after:.1f} s after rank 0 froze (timeout {TIMEOUT:g} s)")
    assert procs[1].returncode != 0
    assert after < TIMEOUT + 60, f"rank 1 ended {after:.0f} s after the freeze"
    message = next((ln for ln in out.splitlines() if "CollectiveError: " in ln), None)
    assert message is not None, out[-6000:]
    assert "rank 1 gave up on" in message and "rank 0 did not answer" in message, message
    assert re.search(r"add\(|all_reduce|all-reduce|broadcast|all_gather|barrier|reduce", message), message


@pytest.mark.parametrize("frozen", [2, 0])
def test_among_three_ranks_the_survivors_name_the_frozen_one(tmp_path, frozen):
    timeout, port = 5.0, _free_port()
    script = Path(__file__).resolve().parent / "scripts" / "frozen_collective.py"
    procs = [subprocess.Popen(
        [sys.executable, str(script), "--timeout", str(timeout), "--freeze-rank", str(frozen), "--out", str(tmp_path)],
        env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3", RANK=str(r),
                 OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(3)]
    try:
        for r, proc in enumerate(procs):
            if r == frozen:
                continue
            try:
                out, _ = proc.communicate(timeout=timeout + 90)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still ran {timeout + 90:g} s after the start with rank {frozen} frozen")
            after = time.time() - float((tmp_path / "frozen").read_text())
            print(f"\n3 ranks, rank {frozen} frozen: rank {r} ended {after:.1f} s after the freeze "
                  f"(timeout {timeout:g} s)")
            assert proc.returncode != 0 and after < timeout + 60
            message = next((ln for ln in out.splitlines() if "CollectiveError: " in ln), "")
            assert f"rank {r} gave up on all_reduce 'hetero_plugins.test'" in message, out[-4000:]
            assert f"rank {frozen} did not answer" in message, message
    finally:
        for proc in procs:
            _kill(proc)


# ------------------------------------------------------------------------------------------ a foreign client
class PreClaim(pl.Callback):
    """Rank 0 plays a client on the network that knows the old key scheme ``hetero_plugins/wbsp/{n}/{rank}``: before
    the first step it connects to the claim store (its own connection, no secret) and claims every micro-batch of
    the first 60 steps of both ranks."""

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        store = trainer.strategy.aggregator.store
        host, port = getattr(store, "address", None) or (store.host, store.port)
        foreign = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        for n in range(60):
            for r in range(2):
                foreign.add(f"hetero_plugins/wbsp/{n}/{r}", 1000)
                foreign.add(f"hp/{trainer.current_epoch}/{n}/{r}", 1000)


def test_claims_under_the_old_key_scheme_change_nothing(tmp_path):
    pl.seed_everything(0)
    model = IndexedDigitsMLP(batch_size=16)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=HeteroDDPStrategy(start_method=START_METHOD, aggregation=AggregationOptions("wbsp", micro_batches=2),
                                   replan_every=None),
        callbacks=[PreClaim(), Report(str(tmp_path))], default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    reports = read_reports(str(tmp_path), 2)
    n = len(model.train_dataloader().dataset)
    seen = sorted(reports[0]["seen"]["0"] + reports[1]["seen"]["0"])
    assert seen == list(range(n)), f"{len(seen)} processed, {len(set(seen))} distinct of {n}"


def test_claims_written_under_the_jobs_own_keys_raise_instead_of_losing_samples(monkeypatch):
    """Two ranks (threads) share wbsp steps through a real TCP store; a foreign client lists the store's keys
    during the second step, finds the job's key namespace and pre-claims rank 1's share of the next steps."""
    from hetero_plugins.aggregation.options import AggregationOptions as Options

    tampered: list[int] = []
    lock = threading.Lock()

    def sleep(rank, step, samples):
        with lock:
            if step < 1 or tampered:
                return 0.0
            store = engine_store[0]
            host, port = getattr(store, "address", None) or (store.host, store.port)
            foreign = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
            keys = [k for k in foreign.list_keys() if re.search(r"hetero_plugins/wbsp/\d+/\d+$", k)]
            assert keys, "the claim keys are in the store"
            prefix = re.sub(r"\d+/\d+$", "", keys[0])
            for n in range(step + 1, step + 9):
                foreign.add(f"{prefix}{n}/1", 1000)
            tampered.append(step + 1)
        return 0.0

    engine_store: list = []
    import hetero_plugins.aggregation.wbsp as wbsp

    original = wbsp.open_claim_store

    def capture(comm, timeout):
        store = original(comm, timeout)
        engine_store.append(store)
        return store

    monkeypatch.setattr(wbsp, "open_claim_store", capture)
    with pytest.raises(ClaimError, match=r"step (\d+): the ranks processed \d+ samples .* of the 8 planned") as err:
        run_engine(Options("wbsp", micro_batches=2), sleep=sleep, times=FixedTimes(1.0, [1.0, 1.0]))
    assert tampered and f"step {tampered[0]}:" in str(err.value)


def test_a_foreign_client_that_repeats_one_micro_batch_and_drops_another_is_named_per_unit(monkeypatch):
    """The totals stay right: during step 1 a client that read the job's keys from ``list_keys`` moves rank 0's
    counter back by one (its micro-batch 0 is handed out again) and rank 1's forward by one (its micro-batch 1 is
    never handed out), every micro-batch holding one sample. Only the per-unit tally can tell."""
    from hetero_plugins.aggregation.options import AggregationOptions as Options
    import hetero_plugins.aggregation.wbsp as wbsp

    engine_store: list = []
    original = wbsp.open_claim_store

    def capture(comm, timeout):
        engine_store.append(original(comm, timeout))
        return engine_store[0]

    monkeypatch.setattr(wbsp, "open_claim_store", capture)
    rank1_waits, attacked, first = threading.Event(), threading.Event(), set()

    def sleep(rank, step, samples):
        if step != 1 or rank in first:
            return 0.0
        first.add(rank)  # each rank's first micro-batch of step 1: its own micro-batch 0, claimed alone
        if rank == 1:
            rank1_waits.set()
            assert attacked.wait(30), "the foreign client did not act"
            return 0.0
        assert rank1_waits.wait(30), "rank 1 did not reach step 1"
        store = engine_store[0]
        host, port = store.address
        foreign = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        keys = [k for k in foreign.list_keys() if re.search(r"hetero_plugins/wbsp/\d+/\d+$", k)]
        step_key = max(keys, key=lambda k: int(k.rsplit("/", 2)[1]))  # this step's counters: the newest
        prefix = step_key.rsplit("/", 1)[0]
        assert foreign.add(f"{prefix}/0", -1) == 0 and foreign.add(f"{prefix}/1", 1) == 2  # both had claimed one
        attacked.set()
        return 0.0

    with pytest.raises(ClaimError) as err:
        run_engine(Options("wbsp", micro_batches=5), sleep=sleep, times=FixedTimes(1.0, [1.0, 1.0]))
    message = str(err.value)
    assert "step 1: the step's samples add up (8 of 8 planned)" in message, message
    assert "rank 0's micro-batch 0 ran 2 times" in message and "rank 1's micro-batch 1 ran 0 times" in message
    assert message.count(" time") == 2 and "HINT" in message, message
