"""Atomic file writes (a reader sees the old file or the new one, never half of one), and reading a file the
user names or else a resource shipped in the package (:func:`read_shipped_or_file`).

The text goes to a fresh temporary file in the target's directory (created with ``O_CREAT | O_EXCL`` under a
random name by :func:`tempfile.mkstemp`, so a file or symlink planted at a predictable name such as
``<path>.tmp`` is never opened), is flushed to disk, and replaces the target with :func:`os.replace` (atomic on
POSIX and Windows within one file system). A symlink at ``path`` itself is replaced by the file, never followed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["check_output_path", "read_shipped_or_file", "write_atomic"]


def read_shipped_or_file(source: str | os.PathLike[str] | None, package: str, resource: str, arg: str,
                         hint: str, what: str = "file") -> tuple[bytes, str]:
    """``(bytes, label)`` of the file ``source``, or of the package resource ``resource`` (a path under
    ``package``) when ``source`` is ``None``; ``label`` names it in error messages ("shipped <what> 'x'" or
    "<what> 'path'"). A ``source`` that is not a file raises ``ValueError`` naming the argument ``arg``, the
    value and ``hint``."""
    if source is None:
        from importlib import resources

        name = resource.rsplit("/", 1)[-1]
        return resources.files(package).joinpath(*resource.split("/")).read_bytes(), f"shipped {what} {name!r}"
    p = Path(source)
    if not p.is_file():
        raise ValueError(f"`{arg}`={str(source)!r} is not a file. HINT: {hint}")
    return p.read_bytes(), f"{what} {str(p)!r}"


def check_output_path(path: str | os.PathLike[str], arg: str, folder: bool = False) -> Path:
    """``path`` if a command can write its output there, else a ``ValueError`` naming the argument ``arg``, the
    value and the fix: checked before the work, so a bad path is not found after it.

    ``folder=False``: ``path`` is a file to write (it may exist; it must not be a directory). ``folder=True``:
    ``path`` is a folder to create or write files in (it must not be a file). In both cases the nearest existing
    folder on the way must be a writable directory (missing folders are created when the output is written).
    """
    p = Path(path)
    text = str(path)
    if not text.strip():
        raise ValueError(f"`{arg}` is empty. HINT: give a {'folder' if folder else 'file'} path.")
    if folder:
        if p.exists() and not p.is_dir():
            raise ValueError(f"`{arg}`={text!r} is a file, not a folder. HINT: give a folder path (it is created "
                             "if needed), or move the file away.")
    elif p.is_dir():
        raise ValueError(f"`{arg}`={text!r} is a directory. HINT: give a file path, e.g. {str(p / 'out')!r}.")
    elif p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"`{arg}`={text!r} exists and is not writable. HINT: make it writable or choose another "
                         "path.")
    anc = p if folder and p.is_dir() else p.parent
    while not anc.exists() and anc != anc.parent:
        if anc.is_symlink():  # a dangling link on the way
            break
        anc = anc.parent
    if not anc.is_dir():
        raise ValueError(f"`{arg}`={text!r} cannot be written: {str(anc)!r} is not a directory. HINT: choose a "
                         "path under an existing folder.")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ValueError(f"`{arg}`={text!r} cannot be written: the folder {str(anc)!r} is not writable. HINT: "
                         "choose a path in a folder you can write, or fix its permissions.")
    return p


def _umask() -> int | None:
    """The process's umask, read without changing it (Linux); ``None`` where that cannot be done."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> Path:
    """Write ``text`` (``str``: UTF-8) to ``path`` atomically; create its directory if needed. Returns the path.

    The file keeps the permissions of the file it replaces; a new one gets those an ordinary write would give
    (``0o666`` less the umask), or owner-only where the umask cannot be read.
    """
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"`text` must be str or bytes, got {type(text).__name__}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    try:
        st = os.lstat(path)
        mode: int | None = stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None
    except FileNotFoundError:
        mode = None
    if mode is None:
        umask = _umask()
        mode = None if umask is None else 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
