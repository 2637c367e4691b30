import os

import pytest

from tests.helpers.distributed import start_fork_server


def pytest_runtest_setup(item):
    """Multi-process tests time their ranks on this machine's cores: they fail in pytest-xdist workers, where
    other tests would take those cores (``make test`` runs them in a second, serial pass)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None and (
            item.get_closest_marker("distributed") or item.get_closest_marker("horovod")):
        pytest.fail(f"{item.nodeid} starts several processes and must not run in a pytest-xdist worker. HINT: run "
                    "`pytest -m 'distributed or horovod'` without -n, and the rest with "
                    "`pytest -m 'not distributed and not horovod' -n 2`, as `make test` does.", pytrace=False)


@pytest.fixture(autouse=True)
def _restore_env():
    """Fail-safe: tests must not leak environment variables (Lightning sets some during fit)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _fork_server(request, tmp_path_factory):
    """Multi-process tests start their ranks from the fork server (tests/helpers/distributed.py): start it before
    the first such test changes anything, so that every rank starts from the session's environment. The ranks'
    own output goes to ``fork_server.log`` in pytest's base temporary folder (a rank's error reaches its test
    with its traceback either way)."""
    if request.node.get_closest_marker("distributed") is not None:
        start_fork_server(str(tmp_path_factory.getbasetemp() / "fork_server.log"))
