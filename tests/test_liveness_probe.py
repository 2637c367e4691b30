"""The liveness probe that names a frozen rank after a collective timed out among more than two ranks.

- :func:`probe_silent` over a shared dict: the ranks that announce within the window answer, the others are named.
- Over the key-value store of Horovod's own rendezvous server (what ``horovodrun --gloo`` jobs have, served by the
  launcher): the server runs here in-process, each "rank" a thread.
- :class:`CollectiveError` names the silent ranks, or, where none is silent, the ranks that answered.
- ``HeteroHorovodStrategy`` has one bounded exchange for its own collectives and the aggregation modes.
"""

from __future__ import annotations

import threading
import time

import pytest

from hetero_plugins.collectives import CollectiveError, probe_silent, probe_window


def test_the_ranks_that_do_not_announce_within_the_window_are_named():
    board: set[int] = set()

    def probe(rank: int, size: int = 4, window: float = 1.0):
        return probe_silent(rank, size, announce=lambda: board.add(rank), heard=lambda: list(board), window=window)

    results: dict[int, tuple[list[int], list[int]]] = {}
    late = threading.Thread(target=lambda: (time.sleep(0.3), results.__setitem__(3, probe(3))))
    late.start()  # rank 3 gives up 0.3 s after rank 0, within rank 0's window
    start = time.monotonic()
    results[0] = probe(0)
    late.join()
    assert results[0] == results[3] == ([1, 2], [0, 3])  # ranks 1 and 2 never probe
    assert 0.9 < time.monotonic() - start < 3
    board.update({1, 2})
    start = time.monotonic()
    assert probe(1) == ([], [0, 1, 2, 3]) and time.monotonic() - start < 0.5  # every rank heard: no wait
    assert probe_window(600) == 15 and probe_window(10) == 5 and probe_window(1) == 3


def test_the_probe_over_horovods_rendezvous_server_names_the_silent_rank():
    pytest.importorskip("horovod.runner.http.http_server")
    from horovod.runner.http.http_server import RendezvousServer

    from hetero_plugins.horovod.exchange import _rendezvous_probe

    server = RendezvousServer()
    port = server.start()
    try:
        results: dict[int, tuple[list[int], list[int]]] = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, _rendezvous_probe(
            "127.0.0.1", port, r, 3, window=2.0))) for r in (0, 2)]  # rank 1 is frozen
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {0: ([1], [0, 2]), 2: ([1], [0, 2])}
    finally:
        server.stop()


def test_the_error_names_the_silent_ranks_or_else_the_ones_that_answered():
    named = str(CollectiveError(2, "allreduce 'x'", [1], timeout=10.0, answered=[0, 2]))
    assert "rank 2 gave up on allreduce 'x' after 10 s: rank 1 did not answer" in named
    unknown = str(CollectiveError(2, "allreduce 'x'", None, timeout=10.0, answered=[0, 1, 2, 3]))
    assert "ranks 0, 1, 2, 3 answered a liveness probe; any other rank is suspect" in unknown and "HINT" in unknown
    alone = str(CollectiveError(2, "allreduce 'x'", None, timeout=10.0, answered=[2]))  # no probe could run
    assert "only rank 2 (this one) is known to be alive" in alone and "every other rank is suspect" in alone
    assert "another rank did not answer" in str(CollectiveError(2, "allreduce 'x'", None, timeout=10.0))


def test_the_horovod_strategy_has_one_bounded_exchange():
    from hetero_plugins.strategies import HeteroHorovodStrategy

    strategy = HeteroHorovodStrategy()
    assert strategy._collectives() is strategy._bounded() is strategy._bounded()
