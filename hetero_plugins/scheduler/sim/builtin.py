"""The built-in scenarios of the simulator (JSON form, as a scenario file would hold them)."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["BUILTIN_SCENARIOS"]

#: Device types of the built-in mixes: fixed seconds per step, seconds per sample, largest local batch.
_MIX_DEVICES: dict[str, dict[str, Any]] = {
    "a100": {"overhead": 0.004, "cost_per_sample": 0.00025, "memory_samples": 1024},
    "v100": {"overhead": 0.005, "cost_per_sample": 0.0005, "memory_samples": 512},
    "t4": {"overhead": 0.006, "cost_per_sample": 0.0012, "memory_samples": 256},
    "k80": {"overhead": 0.008, "cost_per_sample": 0.0025, "memory_samples": 256},
    "cpu": {"overhead": 0.010, "cost_per_sample": 0.0060, "memory_samples": 512},
}


def _mix(name: str, groups: list[tuple[str, int, float]], gb: int, **extra: Any) -> dict[str, Any]:
    """A built-in scenario in the scenario schema: ``groups`` of ``(device, count, data seconds)``."""
    spec = {
        "name": name,
        "global_batch": gb,
        "workload": "training",
        "devices": copy.deepcopy(_MIX_DEVICES),
        "ranks": [{"device": d, "corunner": None, "count": n, "data": data} for d, n, data in groups],
        # Ring all-reduce of ~2.5 M float32 gradients over a 5 GB/s network: ~4 ms per step at 8 ranks.
        "allreduce": {"latency": 0.0005, "bytes": 1.0e7, "bandwidth": 5.0e9},
        "interference": {
            "video": {"a100": 1.3, "v100": 1.5, "t4": 1.9, "k80": 1.7, "cpu": 1.4},
            "inference": {"a100": 1.15, "v100": 1.25, "t4": 1.5, "k80": 1.35, "cpu": 1.2},
            "etl": {"a100": 1.05, "v100": 1.05, "t4": 1.1, "k80": 1.1, "cpu": 2.2},
        },
    }
    spec.update(extra)
    return spec


#: Built-in scenarios (JSON form; load with :func:`load_scenario`).
BUILTIN_SCENARIOS: dict[str, dict[str, Any]] = {
    # An elastic cluster where a rank is lost and another joins (the default co-runner table, DEFAULT_CORUNNERS).
    "elastic": {
        "name": "elastic",
        "description": "Elastic cluster: a co-runner arrives, a rank is lost, a rank joins.",
        "devices": {"a100": {"cost_per_sample": 0.00025, "overhead": 0.004, "memory_samples": 1024},
                    "v100": {"cost_per_sample": 0.0005, "overhead": 0.005, "memory_samples": 512},
                    "t4": {"cost_per_sample": 0.0012, "overhead": 0.006, "memory_samples": 256}},
        "ranks": [{"device": "a100", "corunner": None}, {"device": "a100", "corunner": None},
                  {"device": "v100", "corunner": None}, {"device": "v100", "corunner": "memcpy"},
                  {"device": "t4", "corunner": None}, {"device": "t4", "corunner": None}],
        "free_slots": [{"device": "v100", "corunner": None}],
        "global_batch": 768, "epochs": 12, "steps_per_epoch": 20, "noise": 0.02, "seed": 0,
        "allreduce": {"latency": 0.0005, "bytes": 1.0e7, "bandwidth": 5.0e9},
        "events": [{"epoch": 3, "rank": 4, "corunner": "video"}, {"epoch": 5, "rank": 1, "lost": True},
                   {"epoch": 8, "add": {"device": "v100", "corunner": None}},
                   {"epoch": 9, "rank": 3, "corunner": None}],
    },
    "paper_mix": _mix(
        "paper_mix", [("v100", 2, 0.0), ("t4", 2, 0.0), ("k80", 2, 0.0), ("cpu", 2, 0.0)], 512,
        description="CPU-GPU heterogeneous cluster (seed paper's setting, Zhang et al. TPDS 2021); one slowdown.",
        epochs=10, steps_per_epoch=20, noise=0.02,
        events=[{"epoch": 5, "ranks": [1], "speed": 1.6}],
    ),
    "static_mix": _mix(
        "static_mix", [("v100", 2, 0.0), ("t4", 2, 0.003), ("k80", 2, 0.0), ("cpu", 2, 0.0)], 512,
        description="A static CPU-GPU mix (no events); two ranks have a slow input pipeline.",
        epochs=8, steps_per_epoch=20, noise=0.02,
    ),
    "interference": _mix(
        "interference", [("v100", 4, 0.0), ("t4", 4, 0.0)], 512,
        description="Co-located streaming jobs arrive on and leave some GPUs (the IAWP stage's setting); "
                    "two idle GPUs could take relocated ranks.",
        epochs=10, steps_per_epoch=20, noise=0.02,
        free_slots=[{"device": "v100", "corunner": None}, {"device": "t4", "corunner": None}],
        events=[
            {"epoch": 2, "ranks": [0, 4], "corunner": "video"},
            {"epoch": 4, "ranks": [5], "corunner": "inference"},
            {"epoch": 6, "ranks": [0], "corunner": None},
            {"epoch": 7, "ranks": [2, 6], "corunner": "video"},
        ],
    ),
    "dynamic": _mix(
        "dynamic", [("v100", 4, 0.0), ("t4", 2, 0.004), ("k80", 2, 0.0)], 512,
        description="Non-dedicated nodes: background load ramps up, a node slows, two ranks have slow input pipelines.",
        epochs=12, steps_per_epoch=20, noise=0.02,
        events=[
            {"epoch": 1, "ranks": [0, 1], "ramp": 2.5, "over": 6},
            {"epoch": 3, "ranks": [6], "ramp": 2.0, "over": 5},
            {"epoch": 8, "ranks": [0, 1], "speed": 1.0},
        ],
    ),
    "large": _mix(
        "large", [("a100", 256, 0.0), ("v100", 256, 0.0), ("t4", 256, 0.0), ("k80", 256, 0.0)], 32768,
        description="1024 ranks of four GPU types; some co-runners arrive.",
        epochs=4, steps_per_epoch=3, noise=0.02,
        events=[
            {"epoch": 1, "ranks": list(range(0, 1024, 7)), "corunner": "video"},
            {"epoch": 2, "ranks": list(range(3, 1024, 11)), "ramp": 2.0, "over": 2},
        ],
    ),
}
