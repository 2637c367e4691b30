"""The lazy ``horovod.torch`` import, with the install hint when Horovod is missing."""

from __future__ import annotations

from typing import Any

__all__ = ["horovod_torch"]


def horovod_torch() -> Any:
    """``horovod.torch``, or an ``ImportError`` that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"hetero_plugins.horovod needs Horovod with PyTorch support ({err}). HINT: run `make horovod` "
            "(builds Horovod 0.28.1 patched for torch 2.x, horovod#3996) or see docs/horovod.md."
        ) from err
    return hvd
