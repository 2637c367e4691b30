"""Run under ``horovodrun -np 2 --gloo``: several check scripts of this folder in one job, one after another, so
the job starts Horovod, torch (and Lightning) once instead of once a script. Each script's docstring says what it
checks. ``argv[1]`` is a directory; each named check writes what its own job would into ``argv[1]/<name>/``. A
check that fails ends the job, as its own job would.

    horovodrun -np 2 --gloo python several_checks.py OUT lightning_check lightning_cluster_check
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# How each script's main() is called, given its own output directory (the arguments its own job would take).
CALLS: dict[str, Callable[..., None]] = {
    "lightning_check": lambda main, d: main(os.path.join(d, "lightning.json"), d),
    "lightning_aggregation_check": lambda main, d: main(os.path.join(d, "aggregation.json")),
    "lightning_cluster_check": lambda main, d: main(d),
    "cluster_check": lambda main, d: main(d),
    "hooks_check": lambda main, d: main(os.path.join(d, "hooks.json")),
    "aggregation_check": lambda main, d: main(os.path.join(d, "aggregation.json"), []),
    # Every phase; the last shuts Horovod down, so this check goes last.
    "regressions_check": lambda main, d: main(d, list(main.__globals__["PHASES"])),
}

if __name__ == "__main__":
    out, names = sys.argv[1], sys.argv[2:]
    unknown = [n for n in names if n not in CALLS]
    if unknown or not names:
        sys.exit(f"several_checks.py: unknown or no checks {unknown}; choose among {sorted(CALLS)}")
    for name in names:
        os.makedirs(os.path.join(out, name), exist_ok=True)
        CALLS[name](importlib.import_module(name).main, os.path.join(out, name))
