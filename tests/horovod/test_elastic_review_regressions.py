"""Review regressions of the Horovod exchange's timeouts and of elastic relocation (real ``horovodrun`` jobs
where Horovod is involved).

- ``HETERO_PLUGINS_TIMEOUT=inf`` (or ``1e999``) was accepted: every collective of the exchange then polled against
  an infinite deadline, so a rank that never joined hung the others forever; ``timeout=nan`` passed to an exchange
  or store never expired either (``monotonic() > nan`` is always false), and ``timeout="600"`` or ``0`` were not
  refused by name. Now every bound must be a positive, finite number of seconds, and a bad one is refused on
  every rank when the sampler (its exchange) is built, naming the variable or argument.
- A long transport error was cut to its last 300 characters, so Horovod's own ("Horovod has been shut down. This
  was caused by an exception on one of the ranks ...", 301 characters) lost its first letter in the
  ``CollectiveError`` that names the silent rank: "[orovod has been shut down". Now both ends are kept.
- Applying a relocation, rank 0 rewrote the hosts file inside the collective that hands every rank its decision: a
  file it could not rewrite (gone, unwritable, a line it cannot parse) raised on rank 0 alone, which crashed the job
  (an elastic job would have lost rank 0's worker instead). And a line without a slot count (``host``, whose slots
  ``horovodrun --slots-per-host`` decides) was read as one slot, so moving one slot off it dropped the host with all
  its slots. Now rank 0 warns, records ``relocation["error"]`` on every rank and training goes on.
- Not a regression (these paths were right, and untested): a graceful host removal and a kill between commits, now
  in the elastic job of ``test_horovod_elastic.py``.
"""

from __future__ import annotations

import json
import sys

import pytest

from hetero_plugins.collectives import (
    MAX_TIMEOUT,
    TIMEOUT_ENV,
    BoundedStore,
    CollectiveError,
    TorchCollectives,
    check_timeout,
)
from hetero_plugins.collectives import default_timeout
from hetero_plugins.horovod.exchange import HorovodExchange
from hetero_plugins.horovod.elastic import move_host_slots
from tests.horovod.conftest import SCRIPTS


@pytest.mark.parametrize("raw", ["inf", "Infinity", "1e999", "nan", "0", "-5", "ten", "600s"])
def test_a_bad_hetero_plugins_timeout_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=rf"HETERO_PLUGINS_TIMEOUT='{raw}' must be a positive, finite.*HINT"):
        default_timeout()
    with pytest.raises(ValueError, match="HETERO_PLUGINS_TIMEOUT"):
        HorovodExchange()


@pytest.mark.parametrize("raw,seconds", [(None, 600.0), ("", 600.0), (" 30 ", 30.0), ("2.5", 2.5),
                                         ("1e9", MAX_TIMEOUT)])
def test_good_hetero_plugins_timeouts(monkeypatch, raw, seconds):
    if raw is None:
        monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(TIMEOUT_ENV, raw)
    assert default_timeout() == seconds and HorovodExchange().timeout == seconds


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1.0, 2 * MAX_TIMEOUT, "600", True, [5]])
def test_a_bad_timeout_argument_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"`timeout` must be"):
        HorovodExchange(timeout=value)
    with pytest.raises(ValueError, match=r"`timeout` must be"):
        TorchCollectives(timeout=value)
    with pytest.raises(ValueError, match=r"`timeout` must be"):
        BoundedStore(object(), value, rank=0)
    store = BoundedStore(object(), 5.0, rank=0)
    with pytest.raises(ValueError, match=r"`timeout` must be"):
        store.add("k", 1, timeout=value)  # a per-call bound too: nan would never expire
    assert check_timeout(7) == 7.0


@pytest.mark.horovod
def test_an_infinite_hetero_plugins_timeout_is_refused_on_every_rank(horovodrun, tmp_path):
    horovodrun(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "review_timeout_check.py"),
                str(tmp_path)], timeout=120, env={TIMEOUT_ENV: "inf"})
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" in result, f"rank {rank} built its sampler with an unbounded wait: {result}"
        assert "HETERO_PLUGINS_TIMEOUT='inf'" in result["error"] and "HINT" in result["error"]


def test_a_long_transport_error_keeps_its_beginning_in_the_collective_error():
    horovod = ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
               "allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown "
               "was caused by an exception, you should see the exception in the log before the first shutdown message.")
    text = str(CollectiveError(1, "broadcast 'hetero_plugins.plan'", [0], cause=horovod))
    assert "rank 0 did not answer" in text and "[Horovod has been shut down. This was caused" in text, text
    assert "before the first shutdown message.]" in text
    gloo = "[/src/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:15745: Connection reset by peer"
    assert "[Read error [127.0.0.1]:15745: Connection reset by peer]" in str(CollectiveError(1, "op", [0], cause=gloo))


# ------------------------------------------------------------------ relocation through the hosts file
def test_move_host_slots_keeps_hosts_without_a_count_and_refuses_to_guess_theirs(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\nb\n\nc:1\n")
    move_host_slots(str(hosts), [("a", "d")])
    assert hosts.read_text() == "a:1\nb\nc:1\nd:1\n"  # b keeps its --slots-per-host slots
    for moves in ([("b", "d")], [("a", "b")]):
        with pytest.raises(ValueError, match=r"host 'b' is listed without a slot count.*HINT: write `b:<slots>`"):
            move_host_slots(str(hosts), moves)
        assert hosts.read_text() == "a:1\nb\nc:1\nd:1\n"  # nothing written
    hosts.write_text("a:two\n")
    with pytest.raises(ValueError, match=r"line 1: 'a:two' is not `host:slots`"):
        move_host_slots(str(hosts), [("a", "d")])


@pytest.mark.horovod
@pytest.mark.parametrize("mode,content,error", [
    ("countless", "localhost\n", "ValueError: "),             # was rewritten to "127.0.0.1:1": localhost's 2 slots gone
    ("delete", "localhost:2\n", "FileNotFoundError: "),       # raised on rank 0 alone: the job failed
])
def test_a_relocation_rank0_cannot_apply_warns_and_training_goes_on(horovodrun, tmp_path, mode, content, error):
    (tmp_path / "hosts").write_text(content)
    horovodrun(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "review_relocation_check.py"),
                str(tmp_path), mode], timeout=150, env={"HETERO_PLUGINS_TIMEOUT": "30"})
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert res[0]["plan_history"] == res[1]["plan_history"]  # every rank adopted rank 0's decision and record
    relocation = res[0]["plan_history"][0]["relocation"]
    assert relocation["moves"] == [[1, 0]] and relocation["error"].startswith(error), relocation
    warned = res[0]["warnings"]
    assert len(warned) == 1 and "is not applied" in warned[0] and "HINT" in warned[0], warned
    assert res[0]["hosts"] == (content if mode == "countless" else None)  # left as it was
    assert len(res[0]["plan_history"]) == 2
