import os

import pytest

from tests.helpers.distributed import start_fork_server


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
