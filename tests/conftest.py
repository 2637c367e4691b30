import os

import pytest


@pytest.fixture(autouse=True)
def _restore_env():
    """Fail-safe: tests must not leak environment variables (Lightning sets some during fit)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
