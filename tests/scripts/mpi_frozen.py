"""One rank of a bare ``mpirun -n N`` job (no Horovod) that runs ``MPIExchange``'s collectives over and over,
until rank ``--freeze-rank`` stops itself (SIGSTOP, after writing ``frozen`` into ``--out``). The survivors must
give up after ``HETERO_PLUGINS_TIMEOUT`` seconds with a ``CollectiveError`` naming the frozen rank; each writes
its message to ``error_rank{r}.txt`` (mpirun may interleave the lines it prints) and exits non-zero.

``python mpi_frozen.py --freeze-rank R --out DIR``
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hetero_plugins.collectives import CollectiveError  # noqa: E402
from hetero_plugins.horovod.exchange import get_exchange  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--freeze-rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = get_exchange("auto")
    assert comm.kind == "mpi", comm.kind  # a bare mpirun launch with mpi4py: the MPI exchange
    rank, size = comm.rank(), comm.size()
    try:
        for step in range(10_000):
            if step == 20 and rank == args.freeze_rank:
                with open(os.path.join(args.out, "frozen"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            op = step % 4
            if op == 0:
                total = comm.allreduce_sum(torch.ones(3), name="test.sum")
                assert total.tolist() == [float(size)] * 3
            elif op == 1:
                assert comm.allgather(np.full(2, rank), name="test.gather")[:, 0].tolist() == list(range(size))
            elif op == 2:
                assert comm.broadcast_object({"step": step} if rank == 0 else None, name="test.bcast") == {"step": step}
            else:
                assert comm.allgather_object(f"r{rank}", name="test.objects") == [f"r{r}" for r in range(size)]
    except CollectiveError as err:
        path = os.path.join(args.out, f"error_rank{rank}.txt")
        with open(path + ".tmp", "w") as f:  # renamed once whole: mpirun may kill this rank mid-write
            f.write(f"{type(err).__name__}: {err}")
        os.replace(path + ".tmp", path)
        raise


if __name__ == "__main__":
    main()
