"""Faults in plain ``horovodrun`` scripts (real ``horovodrun -np 2 --gloo`` jobs, bounded in time).

- Ranks that build ``hh.HeteroBatchSampler`` differently (``num_samples`` 240 vs 200, ``batch_size`` 8 vs 6)
  used to lay out different epochs and wait for each other until killed; now the first ``set_epoch`` raises on
  every rank an error naming the rank that differs and in what, and the job ends.
- A rank that stalls after its backward pass, with a parameter that got no gradient, ends the job within the
  timeout (plain ``"weighted"`` and the Lightning strategy): Horovod's ``synchronize()`` used to start that
  parameter's all-reduce itself and wait for it without a bound.
- A rank that freezes (``SIGSTOP``) ends the job with an error naming it and the collective, in ``"weighted"``
  (Horovod's own gradient all-reduce) and in ``"wbsp"`` (the claim store rank 0 serves). Of three ranks with no
  store (``"weighted"``), the survivors name the frozen one from a liveness probe over Horovod's rendezvous
  server.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from tests.horovod.conftest import SCRIPTS, run_job

pytestmark = pytest.mark.horovod

TIMEOUT = 4  # HETERO_PLUGINS_TIMEOUT in the freeze jobs
GLOO_TIMEOUT = 6  # HOROVOD_GLOO_TIMEOUT_SECONDS
#: horovodrun's line once a rank has exited with an error: the job is ending (see ``run_job``'s ``stop_after``).
TEARDOWN = "Terminating remaining workers after failure of Process"


def test_ranks_that_disagree_on_the_sampler_all_raise_naming_the_rank_and_the_argument(horovod_available, tmp_path):
    start = time.monotonic()
    res = run_job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "faults_check.py"),
                   str(tmp_path), "mismatch"], timeout=90)
    took = time.monotonic() - start
    print(f"\nmismatch: the job ended after {took:.1f} s (start-up included)")
    assert res.returncode != 0, res.stdout[-4000:]
    assert "rank 1 has seed=1 but rank 0 has seed=0" in res.stdout, res.stdout[-4000:]
    for rank in range(2):
        messages = json.loads((tmp_path / f"mismatch_rank{rank}.json").read_text())
        assert "rank 1 has num_samples=200 but rank 0 has num_samples=240" in messages["num_samples"]
        assert ("rank 1 has batch_size=6 (global batch 12) but rank 0 has batch_size=8 (global batch 16)"
                in messages["batch_size"])
        assert all("HINT" in m for m in messages.values())
    assert took < 60


@pytest.mark.parametrize("mode", ["weighted", "wbsp", "lightning_epoch_end"])
def test_a_frozen_rank_0_ends_the_job_with_an_error_naming_it(horovod_available, tmp_path, mode):
    """``lightning_epoch_end``: ``Trainer(strategy=HeteroHorovodStrategy())``, rank 0 frozen at the end of an epoch,
    where the strategy's own collectives (the balancer's gather and broadcast) wait for it."""
    env = {"HETERO_PLUGINS_TIMEOUT": str(TIMEOUT), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT)}
    res = run_job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "faults_check.py"),
                   str(tmp_path), f"freeze:{mode}"], timeout=TIMEOUT + 100, env=env, stop_after=TEARDOWN)
    ended = time.time()
    frozen = tmp_path / "frozen"
    assert frozen.exists(), res.stdout[-4000:]
    after = ended - float(frozen.read_text())
    print(f"\n{mode}: the job ended {after:.1f} s after rank 0 froze (timeout {TIMEOUT} s)")
    assert res.returncode != 0 and TEARDOWN in res.stdout, res.stdout[-4000:]
    assert after < TIMEOUT + 60
    recorded = tmp_path / "error_rank1.txt"  # written whole by the Lightning job; horovodrun may split stdout lines
    message = recorded.read_text() if recorded.exists() else None
    if message is None or "CollectiveError: " not in message:
        message = next((ln for ln in res.stdout.splitlines() if "CollectiveError: " in ln), None)
    assert message is not None, res.stdout[-6000:]
    assert "rank 1" in message and "rank 0 did not answer" in message, message
    assert re.search(r"allreduce|allgather|broadcast|add\(", message), message


@pytest.mark.parametrize("kind", ["plain", "plain_sync", "lightning"])
def test_a_stalled_rank_with_an_unused_parameter_ends_within_the_timeout(horovod_available, tmp_path, kind):
    """A parameter that got no gradient has no all-reduce until Horovod's ``synchronize()`` starts one, which it
    then waited for without a bound (the job hung as long as the peer stalled, ``HETERO_PLUGINS_TIMEOUT``
    ignored). Rank 1 sleeps 60 s after its backward pass (``"weighted"`` ``hh.DistributedOptimizer``, or
    ``HeteroHorovodStrategy``'s ``post_backward``; ``plain_sync``: the user calls ``optimizer.synchronize()`` to
    clip the gradients, then steps inside ``skip_synchronize()``); rank 0 must raise within the timeout, naming
    rank 1."""
    env = {"HETERO_PLUGINS_TIMEOUT": str(TIMEOUT), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT)}
    res = run_job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "faults_check.py"),
                   str(tmp_path), f"stall:{kind}"], timeout=90, env=env, stop_after=TEARDOWN)
    ended = time.time()
    frozen = tmp_path / "frozen"
    assert frozen.exists(), res.stdout[-4000:]
    after = ended - float(frozen.read_text())
    print(f"\nstall:{kind}: the job ended {after:.1f} s after rank 1 stalled (timeout {TIMEOUT} s)")
    assert res.returncode != 0
    recorded = tmp_path / "error_rank0.txt"
    assert recorded.exists(), res.stdout[-6000:]
    message = recorded.read_text()
    assert message.startswith("CollectiveError: ") and "rank 0" in message, message
    assert "rank 1 did not answer" in message and "gradient allreduce" in message, message
    assert after < TIMEOUT + 30, f"the job ended {after:.1f} s after the stall (it lasts 60 s): {message}"


def test_among_three_ranks_with_no_store_the_survivors_name_the_frozen_one(horovod_available, tmp_path):
    """``"weighted"`` under ``horovodrun -np 3``: rank 1's training loop hangs (a long sleep: Horovod's background
    thread runs on, so Horovod itself never fails) before Horovod's gradient all-reduce; rank 0 and rank 2 give
    up after the timeout and, unable to tell who is missing from the collective itself, ask each other through
    the rendezvous server."""
    timeout = 6
    env = {"HETERO_PLUGINS_TIMEOUT": str(timeout), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT)}
    res = run_job(["-np", "3", "-H", "localhost:3", "--gloo", sys.executable, str(SCRIPTS / "faults_check.py"),
                   str(tmp_path), "freeze:weighted:1:sleep"], timeout=timeout + 100, env=env, stop_after=TEARDOWN)
    ended = time.time()
    frozen = tmp_path / "frozen"
    assert frozen.exists(), res.stdout[-4000:]
    after = ended - float(frozen.read_text())
    print(f"\nweighted, 3 ranks: the job ended {after:.1f} s after rank 1 hung (timeout {timeout} s)")
    assert res.returncode != 0
    assert after < timeout + 60
    messages = {r: (tmp_path / f"error_rank{r}.txt").read_text() for r in (0, 2)
                if (tmp_path / f"error_rank{r}.txt").exists()}
    assert messages, res.stdout[-6000:]  # the first survivor to give up ends the job (horovodrun stops the rest)
    for r, message in messages.items():
        assert message.startswith("CollectiveError: ") and f"rank {r}" in message, message
        assert "rank 1 did not answer" in message, message
        assert re.search(r"allreduce|allgather|broadcast", message), message
