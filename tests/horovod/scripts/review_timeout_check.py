"""A bad ``HETERO_PLUGINS_TIMEOUT`` under ``horovodrun``: run as
``HETERO_PLUGINS_TIMEOUT=... horovodrun -np 2 -H localhost:2 --gloo python review_timeout_check.py OUT_DIR``.

Every rank builds a :class:`hetero_plugins.horovod.HeteroBatchSampler` (its exchange reads the variable) and writes
``OUT_DIR/rank<r>.json``: ``{"built": true, "timeout": ...}`` or ``{"error": ...}``. It exits 0 either way, so the
test reads what each rank saw.
"""

from __future__ import annotations

import json
import os
import sys

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import hetero_plugins.horovod as hh  # noqa: E402


def main(out_dir: str) -> None:
    hvd.init()
    try:
        sampler = hh.HeteroBatchSampler(64, batch_size=4, seed=0)
        result = {"built": True, "timeout": sampler.exchange.timeout}
    except ValueError as err:
        result = {"error": str(err)}
    with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
