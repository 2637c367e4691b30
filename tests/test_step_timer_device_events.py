"""``StepTimer`` on a device that runs asynchronously to the host (CUDA): compute time from events on the device's
stream, read lazily, not from host time stamps at the gradient hooks (which only say when the work was queued).

The events here are a small stand-in with the interface of ``torch.cuda.Event`` (``record``, ``synchronize``,
``elapsed_time`` in ms) over a simulated device clock, since this machine has no GPU; ``make gpu-check`` runs the
same timer with real CUDA events (``scripts/gpu_check.py``, "step timer on CUDA").
"""

from __future__ import annotations

import pytest
import torch

from hetero_plugins.telemetry import StepRecord, StepTimer


class Device:
    """A device with a queue: the host enqueues work instantly; the device runs it in order."""

    def __init__(self) -> None:
        self.host = 0.0  # the host's clock (s)
        self.busy_until = 0.0  # when the device finishes what is queued (s)
        self.syncs = 0

    def clock(self) -> float:
        return self.host

    def launch(self, seconds: float, host_cost: float = 0.001) -> None:
        self.host += host_cost
        self.busy_until = max(self.busy_until, self.host) + seconds

    def event(self) -> "Event":
        return Event(self)


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.at = device, None

    def record(self) -> None:  # fires when the device reaches it
        self.at = max(self.device.busy_until, self.device.host)

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.host = max(self.device.host, self.at)

    def elapsed_time(self, end: "Event") -> float:
        return (end.at - self.at) * 1e3


def run_steps(timer: StepTimer, dev: Device, per_sample: float, batches: list[int]) -> list[StepRecord]:
    out = []
    for b in batches:
        timer.start_step(b)
        dev.launch(per_sample * b)  # forward + backward, queued
        timer.mark_gradients_ready()  # the hook fires as soon as the host has queued the last bucket
        dev.launch(0.002)  # optimizer step
        out.append(timer.end_step())
        dev.host += 0.0005  # the host fetches the next batch
    return out


def test_device_time_replaces_the_hosts_launch_time():
    dev = Device()
    timer = StepTimer(clock=dev.clock, event_factory=dev.event)
    host_records = run_steps(timer, dev, per_sample=0.01, batches=[16, 32, 16])
    # The host's stamps measure only the launch (1 ms), whatever the batch: they cannot tell a slow GPU apart.
    assert all(r.compute_time == pytest.approx(0.001) for r in host_records)
    assert dev.syncs == 0  # nothing waited for the device while stepping
    recs = timer.pop_records()
    # The device's time grows with the batch (10 ms a sample), including waiting behind the previous step's work.
    assert [r.batch_size for r in recs] == [16, 32, 16]
    assert recs[1].compute_time == pytest.approx(0.32, rel=0.02)
    assert recs[1].compute_time > 1.9 * recs[0].compute_time
    assert timer.pop_records() == []


def test_a_slow_device_shows_in_the_events_not_in_the_host_stamps():
    fast, slow = Device(), Device()
    t_fast = StepTimer(clock=fast.clock, event_factory=fast.event)
    t_slow = StepTimer(clock=slow.clock, event_factory=slow.event)
    h_fast = run_steps(t_fast, fast, 0.001, [32] * 5)
    h_slow = run_steps(t_slow, slow, 0.004, [32] * 5)  # a 4x slower device (an MPS share, a co-runner)
    assert h_slow[-1].compute_time == pytest.approx(h_fast[-1].compute_time)
    r_fast, r_slow = t_fast.pop_records(), t_slow.pop_records()
    ratio = r_slow[-1].compute_time / r_fast[-1].compute_time
    assert ratio == pytest.approx(4.0, rel=0.15)


def test_data_time_stays_on_the_host_and_can_be_replaced_without_a_sync():
    dev = Device()
    timer = StepTimer(clock=dev.clock, event_factory=dev.event)
    run_steps(timer, dev, 0.01, [8, 8])
    timer.set_data_time(0.25)
    assert dev.syncs == 0
    recs = timer.records
    assert recs[-1].data_time == 0.25 and recs[-1].compute_time == pytest.approx(0.08, rel=0.05)
    assert recs[0].data_time == pytest.approx(0.0)  # the first step has no previous end


def test_without_a_hook_the_backward_end_or_the_step_end_is_the_ready_point():
    dev = Device()
    timer = StepTimer(clock=dev.clock, event_factory=dev.event)
    timer.start_step(4)
    dev.launch(0.05)
    timer.mark_backward_end()
    timer.end_step()
    timer.start_step(4)
    dev.launch(0.05)
    timer.end_step()  # no mark at all: the step's end
    recs = timer.pop_records()
    assert [r.compute_time for r in recs] == pytest.approx([0.051, 0.05], rel=0.05)


def test_the_host_clock_on_cpu_and_events_only_on_cuda():
    assert not StepTimer(device="cpu").uses_events
    assert not StepTimer(device=torch.device("cpu")).uses_events
    assert not StepTimer().uses_events
    t = StepTimer(device="cuda:0")
    assert t.uses_events == torch.cuda.is_available()


class Broken(Event):
    def elapsed_time(self, end: Event) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_an_event_that_cannot_be_read_falls_back_to_the_host_time():
    dev = Device()
    timer = StepTimer(clock=dev.clock, event_factory=lambda: Broken(dev))
    host = run_steps(timer, dev, 0.01, [8])
    assert timer.pop_records() == host
