"""Run a command on a pseudo-terminal, as a person at a terminal runs it, and collect what it draws."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time


def run_in_terminal(cmd: list[str], cwd=None, env=None, timeout: float = 300.0, columns: int = 120) -> tuple[int, str]:
    """Return the exit code and everything written to the terminal (standard output and error together)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))  # a terminal has a width
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the other side closed: the command ended
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise TimeoutError(f"{cmd} ran past {timeout} s")
        return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(master)
