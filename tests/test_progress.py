"""Progress on long jobs: a bar with rate and time left on a terminal; nothing in logs or with --quiet."""

from __future__ import annotations

import io
import os
import re
import sys
import time

from hetero_plugins.progress import QUIET_ENV, progress, set_quiet, timed
from tests.helpers.terminal import run_in_terminal

BAR = re.compile(r"(\d+)/(\d+) \[[0-9:]+<[0-9:?]+")  # count/total [elapsed<remaining


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_shows_count_rate_and_time_left_on_a_terminal():
    screen = Terminal()
    assert list(progress(range(3), desc="simulate", unit="run", stream=screen)) == [0, 1, 2]
    text = screen.getvalue()
    assert "simulate: 100%" in text and " 3/3 [" in text and "run/s" in text
    assert BAR.search(text)


def test_no_bar_off_a_terminal_or_when_quiet():
    assert list(progress(range(3), stream=io.StringIO())) == [0, 1, 2]  # a log file: nothing drawn, items pass
    screen = Terminal()
    set_quiet(True)
    assert os.environ[QUIET_ENV] == "1"
    bar = progress(range(3), stream=screen)
    assert list(bar) == [0, 1, 2] and not bar.active and screen.getvalue() == ""
    set_quiet(False)
    assert QUIET_ENV not in os.environ


def test_time_budget_bar_fills_with_the_clock_and_ends_full():
    screen = Terminal()
    with timed(0.6, desc="NCF pre-training", tick=0.1, stream=screen) as bar:
        assert bar.active
        time.sleep(0.35)
    text = screen.getvalue()
    assert "NCF pre-training" in text and "s of budget" in text
    shown = [float(n) for n in re.findall(r"\| ([0-9.]+)/0\.6 s of budget", text)]
    assert 0.0 < shown[len(shown) // 2] < 0.6 and shown[-1] == 0.6  # moved with time, then full at the end


def test_simulate_draws_a_bar_on_a_terminal_and_none_with_quiet(tmp_path):
    cmd = [sys.executable, "-m", "hetero_plugins.cli", "simulate", "--scenario", "paper_mix"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    rc, screen = run_in_terminal(cmd, cwd=tmp_path, env=env, timeout=120)
    assert rc == 0, screen[-2000:]
    assert "simulate paper_mix: 100%" in screen and "6/6 [" in screen and "run/s" in screen
    assert "policy / oracle" in screen  # the results, after the bar
    rc, screen = run_in_terminal(cmd + ["--quiet"], cwd=tmp_path, env=env, timeout=120)
    assert rc == 0 and "policy / oracle" in screen and "simulate paper_mix:" not in screen and not BAR.search(screen)


def test_pretrain_shows_its_time_budget_and_says_where_it_wrote(tmp_path):
    rc, screen = run_in_terminal([sys.executable, "-m", "hetero_plugins.cli", "pretrain", "--stage", "ncf",
                                  "--seconds", "1.5", "--out", str(tmp_path / "models")],
                                 cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=120)
    assert rc == 0, screen[-2000:]
    assert "NCF pre-training: 100%" in screen and "1.0/1.0 s of budget" in screen  # a third, at least 1 s
    assert f"wrote {tmp_path / 'models' / 'ncf_v1.npz'}" in screen and (tmp_path / "models" / "ncf_v1.npz").is_file()
