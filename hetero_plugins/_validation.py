"""Argument checks shared by the public classes: each error names the argument, the value and the fix."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer (a Python or NumPy one, not a bool) of at least
    ``minimum``, else raise ``ValueError``."""
    fix = f"pass an int{'' if minimum is None else f' of at least {minimum}'}, e.g. {name}={max(minimum or 0, 1)}."
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).{_hint(hint, fix)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.{_hint(hint, fix)}")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
    hint: str = "",
) -> float:
    """Return ``float(value)`` if it is a finite real number within the bounds, else raise ``ValueError``."""
    low = "" if minimum is None else f"{'above' if strict_minimum else 'at least'} {minimum}"
    high = "" if maximum is None else f"at most {maximum}"
    fix = f"pass a finite number{' ' if low or high else ''}{' and '.join(x for x in (low, high) if x)}."
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.{_hint(hint, fix)}")
    value = float(value)
    if minimum is not None:
        if strict_minimum and value <= minimum:
            raise ValueError(f"`{name}` must be > {minimum}, got {value}.{_hint(hint, fix)}")
        if not strict_minimum and value < minimum:
            raise ValueError(f"`{name}` must be >= {minimum}, got {value}.{_hint(hint, fix)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"`{name}` must be <= {maximum}, got {value}.{_hint(hint, fix)}")
    return value


def check_positive_floats(name: str, values: Any, *, length: int | None = None, hint: str = "") -> list[float]:
    """Return ``values`` (a sequence or a 1-D NumPy array) as a list of floats, each finite and > 0, optionally of
    a given length."""
    fix = f"pass a list of {'' if length is None else f'{length} '}positive finite numbers."
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"`{name}` must be a non-empty sequence of positive numbers, got {values!r}."
                         f"{_hint(hint, fix)}")
    if length is not None and len(values) != length:
        raise ValueError(f"`{name}` must have {length} entries (one per rank), got {len(values)}: {list(values)!r}."
                         f"{_hint(hint, fix)}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"`{name}[{i}]` must be a positive finite number, got {v!r}.{_hint(hint, fix)}")
        out.append(float(v))
    return out


def check_bool(name: str, value: Any, hint: str = "") -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (a NumPy bool too), else raise ``ValueError``."""
    if not isinstance(value, (bool, np.bool_)):
        fix = "pass the bool True or False (a string such as 'False' is not one)."
        raise ValueError(f"`{name}` must be True or False, got {value!r}.{_hint(hint, fix)}")
    return bool(value)


def check_path(name: str, value: Any, *, must_exist: bool = False, writable: bool = False,
               hint: str = "") -> str | None:
    """Return ``value`` as a ``str`` path (``None`` stays ``None``) if it is a ``str`` or ``os.PathLike`` (and,
    with ``must_exist``, an existing file; with ``writable``, not a directory, under a nearest existing folder
    this process may write: the folders below it are made when the file is written), else raise ``ValueError``."""
    import os

    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"`{name}` must be a file path, got {value!r}.{_hint(hint, 'pass a str or pathlib.Path.')}")
    path = str(value)
    if must_exist and not os.path.isfile(path):
        raise ValueError(f"`{name}`={path!r} is not an existing file.{_hint(hint)}")
    if writable:
        example = f" ({hint})" if hint else ""
        if os.path.isdir(path):
            raise ValueError(f"`{name}`={path!r} is a directory. HINT: name a file in it{example}.")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"`{name}`={path!r} cannot be written ({parent!r} is not a writable folder). HINT: name "
                             f"a file under a folder this process may write{example}.")
    return path


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError`` listing them (and the nearest name
    to a mistyped one)."""
    if not isinstance(value, str) or value not in choices:
        near = difflib.get_close_matches(value, list(choices), n=1) if isinstance(value, str) else []
        hint = f"did you mean {near[0]!r}?" if near else f"use one of {sorted(choices)}."
        raise ValueError(f"`{name}` must be one of {sorted(choices)}, got {value!r}. HINT: {hint}")
    return value


def _hint(hint: str, fix: str = "") -> str:
    """`` HINT: ...`` with the caller's hint, else the check's own generic ``fix`` (so that every error names one)."""
    return f" HINT: {hint or fix}" if hint or fix else ""
