"""Review regressions of GPU telemetry (no GPU here: NVML is faked by monkeypatching ``pynvml``'s functions).

- a rank that sees only some GPUs (``CUDA_VISIBLE_DEVICES``) read the host's GPU with the same *NVML* index as its
  CUDA index, i.e. another rank's GPU: ``cuda:1`` under ``CUDA_VISIBLE_DEVICES=2,3`` is physical GPU 3, not 1;
- NVML missing, without a driver, or failing mid-run degraded silently (debug logs only): now exactly one
  ``RuntimeWarning`` per process, and training never sees an exception;
- a reading without a number for ``gpu_mem_used`` raised ``TypeError`` out of ``UtilisationSampler.stop()`` (so
  out of ``set_epoch``); and an epoch mean was taken over every reading, also those that lacked the key, so a
  reading NVML could not give diluted it (10 % read twice in 30 readings gave 0.67 %).
"""

from __future__ import annotations

import sys
import time
import types
import warnings

import pynvml
import pytest

from hetero_plugins import telemetry
from hetero_plugins.telemetry import SystemMonitor, UtilisationSampler, epoch_stats


class FakeNVML:
    """Four GPUs as NVML numbers them (PCI bus order); GPU i is (10 * (i + 1)) % busy with (i + 1) GB used."""

    def __init__(self, n: int = 4, fail_after: int | None = None, init_error: int | None = None) -> None:
        self.uuids = [f"GPU-{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}" for i in range(n)]
        self.fail_after, self.init_error, self.util_reads = fail_after, init_error, 0

    def install(self, mp: pytest.MonkeyPatch) -> FakeNVML:
        fake = self

        class Handle:
            def __init__(self, i: int) -> None:
                self.i = i

        def init() -> None:
            if fake.init_error is not None:
                raise pynvml.NVMLError(fake.init_error)

        def by_index(i: int) -> Handle:
            if not 0 <= i < len(fake.uuids):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return Handle(i)

        def by_uuid(uuid: str | bytes) -> Handle:
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            if uuid not in fake.uuids:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            return Handle(fake.uuids.index(uuid))

        def util(h: Handle) -> types.SimpleNamespace:
            fake.util_reads += 1
            if fake.fail_after is not None and fake.util_reads > fake.fail_after:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return types.SimpleNamespace(gpu=10.0 * (h.i + 1), memory=0)

        mp.setattr(pynvml, "nvmlInit", init)
        mp.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(fake.uuids))
        mp.setattr(pynvml, "nvmlDeviceGetHandleByIndex", by_index)
        mp.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
        mp.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: fake.uuids[h.i])
        mp.setattr(pynvml, "nvmlDeviceGetUtilizationRates", util)
        mp.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                   lambda h: types.SimpleNamespace(used=1e9 * (h.i + 1), total=16e9, free=0))
        return self


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(telemetry, "_WARNED", set())  # the once-per-process warnings, per test
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _runtime_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("visible,cuda_index,physical", [
    (None, 1, 1),                                   # all GPUs visible: the indices agree
    ("2,3", 1, 3),                                  # cuda:1 of a rank that sees GPUs 2 and 3
    ("3", 0, 3),                                    # one GPU per rank (a common launcher set-up)
    ("GPU-222aaaa-0000-0000-0000-000000000002,0", 0, 2),  # by UUID
    ("GPU-111", 0, 1),                              # by a unique UUID prefix, as CUDA accepts
])
def test_the_monitor_reads_the_gpu_this_process_numbers_cuda_index(monkeypatch, visible, cuda_index, physical):
    FakeNVML().install(monkeypatch)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reading = SystemMonitor(cuda_index).read()
        sampler = UtilisationSampler(gpu_index=cuda_index)
        sampler.sample()
    assert reading["gpu_util"] == 10.0 * (physical + 1) and reading["gpu_mem_used"] == 1e9 * (physical + 1)
    assert sampler.epoch_means()["gpu_util"] == 10.0 * (physical + 1)
    assert not _runtime_warnings(record)


def test_a_cuda_index_outside_cuda_visible_devices_turns_gpu_readings_off_with_one_warning(monkeypatch):
    FakeNVML().install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        monitors = [SystemMonitor(1), SystemMonitor(1)]
        readings = [m.read() for m in monitors]
    assert not any(m.has_gpu for m in monitors) and all("gpu_util" not in r for r in readings)
    messages = _runtime_warnings(record)
    assert len(messages) == 1 and "CUDA device 1" in messages[0] and "NVML" in messages[0], messages


@pytest.mark.parametrize("how", ["no driver", "no pynvml"])
def test_without_nvml_one_warning_and_no_gpu_readings(monkeypatch, how):
    if how == "no driver":
        FakeNVML(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    else:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sampler, monitor = UtilisationSampler(gpu_index=0, interval=0.01), SystemMonitor(0)
        sampler.start()
        stats = epoch_stats(sampler, monitor)  # what the sampler's set_epoch calls
    assert not sampler.active and not monitor.has_gpu and "gpu_util" not in stats
    messages = _runtime_warnings(record)
    assert len(messages) == 1 and "GPU telemetry" in messages[0] and "HINT" in messages[0], messages


def test_nvml_failing_mid_run_warns_once_and_keeps_what_still_reads(monkeypatch):
    FakeNVML(fail_after=2).install(monkeypatch)  # utilisation fails from the third reading on (GPU lost)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sampler, monitor = UtilisationSampler(gpu_index=0, interval=0.01), SystemMonitor(0)
        sampler.start()
        time.sleep(0.3)  # ~30 readings on the thread, all but two failing
        stats = epoch_stats(sampler, monitor)
        assert "gpu_util" not in monitor.read() and monitor.read()["gpu_mem_used"] == 1e9
    messages = _runtime_warnings(record)
    assert len(messages) == 1 and "utilisation" in messages[0], messages
    assert stats["gpu_util"] == pytest.approx(10.0) and stats["gpu_mem_used"] == 1e9  # memory kept being read


def test_a_reading_without_a_number_never_raises_out_of_stop():
    values = iter([{"gpu_util": 5.0, "gpu_mem_used": None}, {"gpu_util": 15.0, "gpu_mem_used": "n/a"},
                   {"gpu_util": 10.0, "gpu_mem_used": 2e9}])
    sampler = UtilisationSampler(read=lambda: next(values))
    for _ in range(3):
        sampler.sample()
    assert sampler.epoch_means() == {"gpu_util": 10.0, "gpu_mem_used": 2e9, "gpu_mem_used_max": 2e9, "samples": 3}
