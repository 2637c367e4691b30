"""Per-rank, per-step telemetry: compute time, data-loading time, samples; GPU and CPU load.

Compute time runs from the start of a batch until this rank's gradients are ready, *before* any gradient
collective: under DDP the all-reduce makes a fast rank wait for the slowest, so timing the whole step sees
no straggler (traceml#252; verified in this project's research, style.md E5). Integrations call
:meth:`StepTimer.mark_gradients_ready` from the gradient-communication hook (DDP comm hook, Horovod
gradient hook) and fall back to the end of backward where no hook fires (gradient accumulation).

GPU utilisation and memory come from NVML (``pynvml``, package ``nvidia-ml-py``) where an NVIDIA driver is
present; CPU load from ``psutil``. Nothing here fails on a machine without a GPU. NVML's utilisation is the
share of the last sample period (1/6 s to 1 s, by GPU) in which a kernel ran, so one reading at an epoch's
end says little (it is often 0% while the ranks wait at a barrier or load data):
:class:`UtilisationSampler` reads it on a light background thread and averages over the epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hetero_plugins._validation import check_float

log = logging.getLogger(__name__)

__all__ = ["EPOCH_STATS", "StepRecord", "StepTimer", "SystemMonitor", "UtilisationSampler", "epoch_stats", "memory_cap",
           "nvml_handle"]

#: Per-rank readings each ``plan_history`` entry holds (a list over ranks, ``None`` where not measured).
EPOCH_STATS = ("cpu_percent", "gpu_util", "gpu_mem_used")


@dataclass(frozen=True)
class StepRecord:
    """One rank's measurements of one step."""

    batch_size: int
    compute_time: float
    data_time: float

    def as_tuple(self) -> tuple[float, float, float]:
        return (float(self.batch_size), self.compute_time, self.data_time)


class StepTimer:
    """Measures one rank's steps. Call ``start_step`` / ``mark_gradients_ready`` / ``end_step`` in order.

    On a CUDA device (:meth:`set_device`) the compute time is read from CUDA events recorded on the stream at
    the step's start and at its last gradient-ready mark, not from the host's clock: the host only *queues*
    kernels, so a host time stamp at a gradient hook says when the backward pass was launched, not when the GPU
    finished it, and a GPU slowed by a co-runner (or an MPS share) would look as fast as the others whenever
    the host runs ahead. The events are read lazily (:attr:`records`, :meth:`pop_records`), so a step adds no
    host synchronisation; reading waits only for the last step's gradients. Data time stays on the host clock
    (it is host work). Elsewhere (CPU, no CUDA) everything is host time.

    Args:
        clock: the host clock, in seconds.
        device: where the step's compute runs (``torch.device``, ``"cuda:1"``, ...; ``None``: the host's clock
            only). Also settable later with :meth:`set_device`, once the training device is known.
        event_factory: makes the timing events (default ``torch.cuda.Event(enable_timing=True)`` on a CUDA
            device): objects with ``record()``, ``synchronize()`` and ``elapsed_time(other)`` in milliseconds.

    Example::

        >>> t = StepTimer()
        >>> t.start_step(8); t.mark_gradients_ready(); rec = t.end_step()
        >>> rec.batch_size, rec.compute_time >= 0
        (8, True)
    """

    def __init__(self, clock: Any = time.perf_counter, device: Any = None,
                 event_factory: Callable[[], Any] | None = None) -> None:
        self._clock = clock
        self._step_start: float | None = None
        self._ready: float | None = None
        self._last_end: float | None = None
        self._batch_size = 0
        self._data_time = 0.0
        self._records: list[StepRecord | _PendingStep] = []
        self._event_factory: Callable[[], Any] | None = None
        self._start_event: Any = None
        self._ready_event: Any = None
        self.set_device(device, event_factory)

    def set_device(self, device: Any, event_factory: Callable[[], Any] | None = None) -> None:
        """Time the compute on ``device``: CUDA events on a CUDA device (or ``event_factory``'s), the host
        clock elsewhere. Takes effect from the next :meth:`start_step`."""
        if event_factory is not None:
            self._event_factory = event_factory
            return
        self._event_factory = None
        if device is None:
            return
        import torch

        dev = torch.device(device) if not isinstance(device, torch.device) else device
        if dev.type == "cuda" and torch.cuda.is_available():
            index = dev.index if dev.index is not None else torch.cuda.current_device()

            def cuda_event() -> Any:
                with torch.cuda.device(index):
                    return torch.cuda.Event(enable_timing=True)

            self._event_factory = cuda_event

    @property
    def uses_events(self) -> bool:
        """Whether compute times come from device events (a CUDA device) rather than the host clock."""
        return self._event_factory is not None

    @property
    def records(self) -> list[StepRecord]:
        """The steps measured since the last :meth:`pop_records` (reading them waits for their events)."""
        self._resolve()
        return self._records  # type: ignore[return-value]

    def start_step(self, batch_size: int) -> None:
        now = self._clock()
        self._data_time = 0.0 if self._last_end is None else max(0.0, now - self._last_end)
        self._step_start = now
        self._ready = None
        self._batch_size = int(batch_size)
        self._start_event = self._ready_event = None
        if self._event_factory is not None:
            self._start_event = self._event_factory()
            self._start_event.record()

    def set_samples(self, batch_size: int) -> None:
        """Correct the samples of the step in progress (micro-batched steps learn it at the end)."""
        self._batch_size = int(batch_size)

    def mark_gradients_ready(self) -> None:
        """This rank's gradients (or a bucket of them) are ready; the last call of a step counts. Called from a
        gradient hook, so on a CUDA device the event goes on the stream that produced the gradients."""
        if self._step_start is not None:
            self._ready = self._clock()
            self._record_ready()

    def mark_backward_end(self) -> None:
        """End of backward; used only where no gradient hook fired during the step."""
        if self._step_start is not None and self._ready is None:
            self._ready = self._clock()
            self._record_ready()

    def end_step(self) -> StepRecord | None:
        """Close the step. Its record is returned (and kept) as measured on the host; where device events time
        it, the kept record gets the device time when read (:attr:`records`)."""
        now = self._clock()
        self._last_end = now
        if self._step_start is None:
            return None
        ready = self._ready if self._ready is not None else now
        rec = StepRecord(self._batch_size, ready - self._step_start, self._data_time)
        if self._start_event is not None:
            if self._ready_event is None:
                self._record_ready()
            self._records.append(_PendingStep(rec, self._start_event, self._ready_event))
        else:
            self._records.append(rec)
        self._step_start = None
        self._start_event = self._ready_event = None
        return rec

    def set_data_time(self, seconds: float) -> None:
        """Replace the data time of the last step ended (an integration that measured the fetch itself)."""
        if not self._records:
            return
        last = self._records[-1]
        if isinstance(last, _PendingStep):
            last.host = dataclasses.replace(last.host, data_time=float(seconds))
        else:
            self._records[-1] = dataclasses.replace(last, data_time=float(seconds))

    def pop_records(self) -> list[StepRecord]:
        out = self.records
        self._records = []
        return out

    def reset_data_clock(self) -> None:
        """Forget the previous step's end (so an epoch boundary is not counted as data loading)."""
        self._last_end = None

    def _record_ready(self) -> None:
        if self._start_event is None:
            return
        if self._ready_event is None:
            self._ready_event = self._event_factory()  # type: ignore[misc]
        self._ready_event.record()  # recorded again at each mark: the last one counts

    def _resolve(self) -> None:
        for i, rec in enumerate(self._records):
            if isinstance(rec, _PendingStep):
                self._records[i] = rec.resolve()


@dataclass
class _PendingStep:
    """A step timed by device events, not read yet: its host record and the events around its compute."""

    host: StepRecord
    start: Any
    ready: Any

    def resolve(self) -> StepRecord:
        try:
            self.ready.synchronize()
            seconds = float(self.start.elapsed_time(self.ready)) / 1e3
        except RuntimeError as err:  # an event that never ran (a device error): keep the host's measurement
            log.debug("device timing of a step unavailable (%s); using the host's clock", err)
            return self.host
        if not (math.isfinite(seconds) and seconds >= 0):
            return self.host
        return dataclasses.replace(self.host, compute_time=seconds)


def memory_cap(batch_size: int, peak_bytes: int, baseline_bytes: int, total_bytes: int, headroom: float = 0.9) -> int:
    """Largest local batch that fits in ``headroom`` of device memory, extrapolating the per-sample cost.

    Example::

        >>> memory_cap(batch_size=10, peak_bytes=3_000, baseline_bytes=1_000, total_bytes=10_000, headroom=0.9)
        40
    """
    per_sample = max(peak_bytes - baseline_bytes, 1) / max(batch_size, 1)
    return max(1, int((headroom * total_bytes - baseline_bytes) // per_sample))


_WARNED: set[str] = set()
_WARN_LOCK = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    """One ``RuntimeWarning`` per process and ``key`` (GPU telemetry is read by several objects and threads; a
    broken NVML must say so once, not at every reading)."""
    with _WARN_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _torch_uuid(cuda_index: int) -> str | None:
    """NVML's UUID string (``"GPU-..."``) of torch's CUDA device ``cuda_index``, where torch can tell (CUDA already
    initialised: this never initialises it)."""
    try:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    except Exception:  # noqa: BLE001 - an old torch or a broken CUDA: fall back to CUDA_VISIBLE_DEVICES
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def nvml_handle(nvml: Any, cuda_index: int) -> Any:
    """NVML's handle of CUDA device ``cuda_index`` as this process numbers it (``torch.cuda`` / ``cuda:N``).

    CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` lists, in its order; NVML numbers every device of the
    host by PCI bus. So the handle comes from the device's UUID where torch can tell it, else from the
    ``cuda_index``-th entry of ``CUDA_VISIBLE_DEVICES`` (an NVML index, or a ``GPU-``/``MIG-`` UUID or UUID prefix,
    as CUDA accepts), else (the variable unset) from NVML index ``cuda_index``. Raises ``ValueError`` where
    ``CUDA_VISIBLE_DEVICES`` has no such entry.
    """
    uuid = _torch_uuid(cuda_index)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:  # noqa: BLE001 - e.g. a MIG UUID an old driver cannot resolve: try the variable
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entries = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break  # CUDA ignores everything from the first entry it cannot parse
        entries.append(entry)
    if cuda_index >= len(entries):
        raise ValueError(f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    try:
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    except Exception:  # noqa: BLE001 - CUDA also takes a unique prefix of the UUID: find the device it names
        matches = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            found = nvml.nvmlDeviceGetUUID(handle)
            found = found.decode() if isinstance(found, bytes) else str(found)
            if found.startswith(entry):
                matches.append(handle)
        if len(matches) != 1:
            raise
        return matches[0]


class SystemMonitor:
    """Reads GPU utilisation/memory through NVML when available, and CPU load through psutil.

    Args:
        gpu_index: this rank's CUDA device as the process numbers it (``torch.cuda.current_device()``, the ``N``
            of ``cuda:N``), or ``None`` on CPU-only ranks. It is mapped to NVML's device through the device's
            UUID or ``CUDA_VISIBLE_DEVICES`` (:func:`nvml_handle`), so a rank that sees only its own GPU reads that
            GPU, not the host's first.

    Without NVML (no ``nvidia-ml-py``, no driver, no such device) GPU readings are left out, with one warning per
    process; a reading that fails during the run (a GPU lost, NVML not answering) is skipped, warned about once,
    and never raises.
    """

    def __init__(self, gpu_index: int | None = None) -> None:
        self.gpu_index = gpu_index
        self._handle: Any = None
        self._nvml: Any = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = nvml_handle(pynvml, int(gpu_index))
                self._nvml = pynvml
            except Exception as err:  # no driver, no device, or no nvidia-ml-py
                self._handle = None
                log.debug("SystemMonitor: NVML unavailable (%s); GPU telemetry disabled", err)
                _warn_once("nvml-init", (
                    f"hetero_plugins: GPU telemetry (utilisation, memory) is off for CUDA device {gpu_index}: NVML is "
                    f"not available ({type(err).__name__}: {err}). Training goes on; plans use step timings only. "
                    "HINT: install nvidia-ml-py with an NVIDIA driver for GPU readings."))

    @property
    def has_gpu(self) -> bool:
        return self._handle is not None

    def read(self) -> dict[str, float]:
        """A snapshot: ``cpu_percent``, ``mem_percent`` and, with a GPU, ``gpu_util``, ``gpu_mem_used``,
        ``gpu_mem_total`` (bytes). A GPU reading NVML fails to give is left out (warned about once)."""
        out: dict[str, float] = {}
        try:
            import psutil

            out["cpu_percent"] = float(psutil.cpu_percent(interval=None))
            out["mem_percent"] = float(psutil.virtual_memory().percent)
        except Exception as err:  # psutil missing or unsupported platform
            log.debug("SystemMonitor: psutil unavailable (%s)", err)
        if self._handle is not None:
            for what, read in (("utilisation", self._read_util), ("memory", self._read_memory)):
                try:
                    out.update(read())
                except Exception as err:  # noqa: BLE001 - a lost GPU or a busy NVML must not stop training
                    log.debug("SystemMonitor: NVML %s read failed (%s)", what, err)
                    _warn_once(f"nvml-read-{what}", (
                        f"hetero_plugins: reading GPU {what} through NVML failed on CUDA device {self.gpu_index} "
                        f"({type(err).__name__}: {err}); such readings are skipped from now on where they fail, "
                        "and training goes on. HINT: check the GPU with nvidia-smi."))
        return out

    def _read_util(self) -> dict[str, float]:
        return {"gpu_util": float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)}

    def _read_memory(self) -> dict[str, float]:
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {"gpu_mem_used": float(mem.used), "gpu_mem_total": float(mem.total)}


class UtilisationSampler:
    """Averages GPU utilisation and memory over an interval (an epoch) from readings on a background thread.

    Every ``interval`` seconds between :meth:`start` and :meth:`stop` it takes one reading (by default
    :meth:`SystemMonitor.read`: ``gpu_util`` %, ``gpu_mem_used`` and ``gpu_mem_total`` bytes, ``cpu_percent``,
    ``mem_percent``); :meth:`epoch_means` returns the mean of every key over the readings since the last call,
    the largest ``gpu_mem_used`` as ``gpu_mem_used_max``, and the number of ``samples``. Without NVML (no
    driver, no GPU, no ``nvidia-ml-py``) and without an injected ``read``, it is a no-op: no thread starts and
    :meth:`epoch_means` returns ``{}``.

    Args:
        gpu_index: this rank's CUDA device as the process numbers it (``torch.cuda.current_device()``), mapped to
            NVML's device as :class:`SystemMonitor` does (``None``: no GPU, a no-op unless ``read`` is given).
        interval: seconds between readings (0.2 costs about 0.1 ms of one CPU core per second).
        read: a function returning one reading as ``{name: value}``; replaces NVML (tests, other devices).

    Example::

        >>> values = iter([{"gpu_util": 30.0}, {"gpu_util": 90.0}])
        >>> s = UtilisationSampler(read=lambda: next(values))
        >>> s.sample(); s.sample()
        >>> s.epoch_means()
        {'gpu_util': 60.0, 'samples': 2}
    """

    def __init__(self, gpu_index: int | None = None, interval: float = 0.2,
                 read: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.interval = check_float("interval", interval, minimum=0.0, strict_minimum=True,
                                    hint="seconds between readings, e.g. 0.2")
        if read is None and gpu_index is not None:
            monitor = SystemMonitor(gpu_index)
            if monitor.has_gpu:
                read = monitor.read
        self._read = read
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}  # readings per key: a key some readings lack is averaged over its own
        self._max_mem = -math.inf
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether readings are available (NVML opened, or a ``read`` function given)."""
        return self._read is not None

    def sample(self) -> None:
        """Take one reading now (the thread calls this; a failed reading is skipped)."""
        if self._read is None:
            return
        try:
            reading = dict(self._read())
        except Exception as err:  # a transient NVML error must not stop training
            log.debug("UtilisationSampler: reading failed (%s)", err)
            return
        values = {k: float(v) for k, v in reading.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        with self._lock:
            for key, value in values.items():
                self._sums[key] = self._sums.get(key, 0.0) + value
                self._counts[key] = self._counts.get(key, 0) + 1
            if "gpu_mem_used" in values:  # a reading without a number (None, text) is not a maximum
                self._max_mem = max(self._max_mem, values["gpu_mem_used"])
            self._count += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        """Start sampling on a daemon thread (no-op if inactive or already running)."""
        if self._read is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="hetero-utilisation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the readings so far stay for :meth:`epoch_means`)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=max(1.0, 5 * self.interval))
        self._thread = None
        self.sample()

    def epoch_means(self, reset: bool = True) -> dict[str, float]:
        """Mean of every key over the readings since the last call (or start) that had a number for it (a key a
        failed NVML call left out is not diluted by those readings), ``gpu_mem_used_max`` and ``samples``;
        ``{}`` without readings. ``reset=False`` keeps accumulating."""
        with self._lock:
            if self._count == 0:
                return {}
            out = {k: v / self._counts[k] for k, v in self._sums.items()}
            if self._max_mem > -math.inf:
                out["gpu_mem_used_max"] = self._max_mem
            out["samples"] = self._count
            if reset:
                self._sums, self._counts, self._max_mem, self._count = {}, {}, -math.inf, 0
        return out

    def __enter__(self) -> UtilisationSampler:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def epoch_stats(sampler: UtilisationSampler, monitor: SystemMonitor) -> dict[str, float]:
    """This rank's readings for an epoch's history entry: GPU utilisation and memory averaged over the epoch by
    ``sampler`` (stopped here) where NVML reads them (a single reading at the epoch end says little: the GPU
    idles while ranks synchronise), CPU load since ``monitor``'s last reading."""
    sampler.stop()
    stats = dict(monitor.read())
    means = sampler.epoch_means()
    stats.update({k: means[k] for k in ("gpu_util", "gpu_mem_used") if k in means})
    return stats
