"""One rank of a 3-rank gloo job that sums a tensor through ``TorchCollectives`` over and over, until rank
``--freeze-rank`` stops itself (SIGSTOP, after writing ``frozen`` into ``--out``). With more than two ranks the
survivors learn who froze from the heartbeats (``TorchCollectives.start_liveness``).

Environment: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` (``init_method="env://"``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hetero_plugins.collectives import TorchCollectives  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--freeze-rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    comm = TorchCollectives(timeout=args.timeout)
    comm.start_liveness()
    for step in range(10_000):
        if step == 20 and comm.rank() == args.freeze_rank:
            with open(os.path.join(args.out, "frozen"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        comm.allreduce_sum(torch.ones(4), name="hetero_plugins.test")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
