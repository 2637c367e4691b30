"""Progress of long command-line jobs: a bar with its rate and the time left, drawn only where someone watches.

Every ``hetero-plugins`` job that runs longer than a few seconds (the demo, the benchmarks, ``simulate``,
``pretrain``, ``transfer``) wraps its loop in :func:`progress`, or its time budget in :func:`timed`::

    from hetero_plugins.progress import progress, timed

    for run in progress(runs, desc="simulating", unit="run"):
        ...
    with timed(20.0, desc="NCF pre-training"):
        train_for(seconds=20.0)

A bar (`tqdm <https://tqdm.github.io>`_, which Lightning already installs) is drawn on standard error when
standard error is a terminal. It is off in logs, pipes and CI, and with ``hetero-plugins --quiet`` (or
``HETERO_PLUGINS_QUIET=1``, which processes spawned by the job inherit). Results and the paths they were
written to go to standard output either way.

This module imports neither Lightning nor torch; without tqdm it draws nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["QUIET_ENV", "Progress", "enabled", "is_quiet", "progress", "set_quiet", "timed"]

#: Environment variable that turns every bar off (``1``); set by ``hetero-plugins --quiet``.
QUIET_ENV = "HETERO_PLUGINS_QUIET"


def set_quiet(quiet: bool = True) -> None:
    """Turn bars off (``True``) or back on, in this process and in the processes it starts afterwards."""
    if quiet:
        os.environ[QUIET_ENV] = "1"
    else:
        os.environ.pop(QUIET_ENV, None)


def is_quiet() -> bool:
    """Whether bars are turned off (``HETERO_PLUGINS_QUIET`` set to anything but ``""`` or ``"0"``)."""
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def enabled(stream: IO[str] | None = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (default standard error): a terminal, and not quiet."""
    stream = sys.stderr if stream is None else stream
    try:
        return not is_quiet() and bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class Progress:
    """A progress bar, or nothing when bars are off; iterate over it or call :meth:`update`.

    Args:
        iterable: what to iterate over (optional: call :meth:`update` instead).
        total: number of units (default ``len(iterable)`` where it has one).
        desc: label in front of the bar.
        unit: name of one unit (``"step"``, ``"run"``, ``"s"``).
        leave: keep the finished bar on screen.
        stream: where to draw (default standard error).
        bar_format: a tqdm ``bar_format`` (default tqdm's: count, rate, elapsed and time left).
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        total: float | None = None,
        desc: str = "",
        unit: str = "it",
        leave: bool = True,
        stream: IO[str] | None = None,
        bar_format: str | None = None,
    ) -> None:
        self.iterable = iterable
        self._bar: Any = None
        if enabled(stream):
            try:
                from tqdm.auto import tqdm
            except ImportError:  # tqdm comes with Lightning; a bare core install draws nothing
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, dynamic_ncols=True,
                                 file=stream or sys.stderr, bar_format=bar_format)

    @property
    def active(self) -> bool:
        """Whether a bar is drawn."""
        return self._bar is not None

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("Progress() was built without an iterable. HINT: pass one, or call update() instead.")
        if self._bar is None:
            yield from self.iterable
            return
        try:
            yield from self._bar
        finally:
            self._bar.close()

    def update(self, n: float = 1) -> None:
        """Advance by ``n`` units."""
        if self._bar is not None:
            self._bar.update(n)

    def moveto(self, n: float) -> None:
        """Set the count to ``n`` units (for bars that follow a clock rather than a loop)."""
        if self._bar is not None:
            self._bar.n = round(float(n), 1)
            self._bar.refresh()

    def set_postfix(self, text: str) -> None:
        """Show ``text`` after the bar (e.g. the epoch and an accuracy)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def write(self, message: str) -> None:
        """Print a line to standard output, above the bar when one is drawn."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    total: float | None = None,
    desc: str = "",
    unit: str = "it",
    leave: bool = True,
    stream: IO[str] | None = None,
) -> Progress:
    """A :class:`Progress` bar over ``iterable`` (or ``total`` units updated by hand)."""
    return Progress(iterable, total=total, desc=desc, unit=unit, leave=leave, stream=stream)


@contextmanager
def timed(seconds: float, desc: str = "", tick: float = 0.5, stream: IO[str] | None = None) -> Iterator[Progress]:
    """A bar that fills with the elapsed time of a job bounded by a time budget of ``seconds``.

    For training loops that run "for N seconds" (the scheduler's pre-training): the bar shows the seconds
    spent, the budget and the time left, updated every ``tick`` seconds by a background thread. Past the
    budget (the final evaluation and saving), it stays full until the block ends.
    """
    total = max(float(seconds), 1e-3)
    digits = 0 if total >= 10 else 1
    count = f"{{n:.{digits}f}}/{{total:.{digits}f}} s of budget"
    bar = Progress(total=round(total, 1), desc=desc, unit="s", stream=stream,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| " + count + " [{elapsed}<{remaining}]")
    stop = threading.Event()
    thread = None
    if bar.active:
        began = time.perf_counter()

        def run() -> None:
            while not stop.wait(tick):
                bar.moveto(min(total, time.perf_counter() - began))

        thread = threading.Thread(target=run, name="hetero-progress", daemon=True)
        thread.start()
    finished = False
    try:
        yield bar
        finished = True
    finally:
        stop.set()
        if thread is not None:
            thread.join()
            if finished:  # done within or past the budget: the bar ends full
                bar.moveto(total)
        bar.close()
