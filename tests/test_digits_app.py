"""The digits CNN of the demo and the benchmarks: its float type, and the benchmark table's exactness row."""

from __future__ import annotations

import pytest
import torch

from hetero_plugins.apps import bench
from hetero_plugins.apps.digits import DigitsCNN


def test_float64_runs_the_network_and_the_data_in_double_precision():
    model = DigitsCNN(dtype="float64")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    x, y = next(iter(model.train_dataloader()))
    assert x.dtype == torch.float64 and model(x).dtype == torch.float64
    assert {p.dtype for p in DigitsCNN().parameters()} == {torch.float32}


def test_an_unknown_dtype_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"`dtype` must be 'float32' or 'float64', got 'float16'.*HINT"):
        DigitsCNN(dtype="float16")


def test_the_bench_table_shows_the_float64_pair_beside_the_timed_one():
    het = {"ddp_steady_epoch_s": 6.0, "hetero_steady_epoch_s": 2.4, "speedup": 2.5, "fraction_of_ideal": 0.91,
           "ideal_speedup": 2.75, "epochs": 12, "ddp_final_acc": 0.9806, "hetero_final_acc": 0.9749,
           "acc_diff_points": -0.57, "target_acc": 0.95, "ddp_time_to_acc_s": 30.0, "hetero_time_to_acc_s": 14.7,
           "time_to_acc_speedup": 2.04,
           "float64": {"ddp_final_acc": 0.9777, "hetero_final_acc": 0.9777, "acc_diff_points": 0.0,
                       "max_weight_gap": 3.2e-15}}
    results = {"heterogeneous": het,
               "homogeneous": {"ddp_steady_epoch_s": 1.7, "hetero_steady_epoch_s": 1.71, "hetero_slower_by": 0.006},
               "slowdown": {"ddp_epoch_after_change_s": 5.0, "hetero_epoch_after_change_s": 2.0,
                            "speedup_one_epoch_after": 2.5, "fraction_of_ideal_one_epoch_after": 0.9,
                            "ideal_speedup": 2.75},
               "meta": {"date": "2026-12-07", "machine": "2 CPU cores", "seconds": 300}}
    text = bench.table(results)
    row = next(line for line in text.splitlines() if "float64" in line)
    assert "| 97.77% | 97.77% | +0.00 points; 3.2e-15 | the same updates: equal to rounding |" in row
    assert "-0.57 points" in text and "the same updates (the float64 row)" in text
