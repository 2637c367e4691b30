"""Measured interference tables: load, validate, train the NCF on them, evaluate it leave-pairs-out.

A table is what ``hetero-plugins profile-interference`` (:mod:`hetero_plugins.scheduler.profile`) writes::

    {"format": 1,
     "machine": {"cpu": "...", "cores": 2, "torch": "2.3.1", "gpu": null, ...},
     "device": "cpu",
     "rows": [{"workload": "mlp", "device": "cpu", "corunner": "membw",
               "solo_s": 0.0021, "shared_s": 0.0026, "slowdown": 1.24, "repeats": 2}, ...]}

``slowdown`` is the per-step time beside the co-runner over the time alone (the geometric mean of the
repeats' ratios, each against its neighbouring solo windows, so not exactly ``shared_s / solo_s``). Other
keys (``settings``, ``workloads``, ``corunners`` descriptions, a row's ``ratios``) are optional.

Stage 2 (Zhang, Geng, Ma, IEEE TPDS 2021, IAWP) learns such a table with neural collaborative filtering:
:func:`train_ncf` fits the :class:`~hetero_plugins.scheduler.ncf.InterferencePredictor` (users: workloads;
items: (device, co-runner)). :func:`leave_pairs_out` holds out each (workload, co-runner) pair (or folds of
pairs), trains on the rest and predicts it, beside an additive baseline (a workload effect plus a co-runner
effect on the log-slowdown, fitted by least squares) that cannot represent that *this* workload suffers
from *that* co-runner: the interaction an NCF exists to learn (He et al., WWW 2017).

The shipped table ``models/interference_cpu.json`` was measured on a two-core x86 machine; the NCF trained
on it ships beside the default (synthetic-table) one as ``models/ncf_measured_cpu.npz``
(:func:`load_measured_predictor`). The default NCF stays the synthetic one: the simulator's scenarios
name devices and co-runners (``v100``, ``video``) that a CPU table does not have.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._files import read_shipped_or_file
from hetero_plugins.scheduler.ncf import InterferencePredictor

__all__ = ["MEASURED_MODEL", "SHIPPED_TABLE", "additive_baseline", "format_table", "leave_pairs_out",
           "load_measured_predictor", "load_table", "measurement_noise", "table_samples", "table_slowdowns",
           "train_ncf", "validate_table"]

SHIPPED_TABLE = "interference_cpu.json"
MEASURED_MODEL = "ncf_measured_cpu.npz"
ROW_FIELDS = {"workload": str, "device": str, "corunner": str, "solo_s": float, "shared_s": float,
              "slowdown": float, "repeats": int}
#: NCF settings for measured tables (tens of rows): small embeddings, a short tower, weight decay.
NCF_SETTINGS = {"dim": 4, "tower": (16, 8), "epochs": 400, "lr": 0.02, "weight_decay": 1e-3}


def _fix(msg: str) -> ValueError:
    return ValueError(msg + " HINT: write tables with `hetero-plugins profile-interference`, or fix the field "
                      "(format 1: {'format': 1, 'machine': {...}, 'device': 'cpu', 'rows': [{'workload', 'device', "
                      "'corunner', 'solo_s', 'shared_s', 'slowdown', 'repeats'}, ...]}).")


def validate_table(table: Any, label: str = "table") -> dict[str, Any]:
    """Check a table (see the module); return it. Errors name the field, the value and the fix."""
    if not isinstance(table, Mapping):
        raise _fix(f"{label} is a {type(table).__name__}, not a JSON object.")
    if table.get("format") != 1:
        raise _fix(f"{label}: `format`={table.get('format')!r}; this version reads format 1.")
    if not isinstance(table.get("machine"), Mapping):
        raise _fix(f"{label}: `machine`={table.get('machine')!r} must be an object describing the machine.")
    if not isinstance(table.get("device"), str) or not table["device"]:
        raise _fix(f"{label}: `device`={table.get('device')!r} must be a device name such as 'cpu' or 'cuda'.")
    rows = table.get("rows")
    if not isinstance(rows, list) or not rows:
        raise _fix(f"{label}: `rows`={rows!r} must be a non-empty list.")
    seen: set[tuple[str, str, str]] = set()
    for k, row in enumerate(rows):
        where = f"{label}: rows[{k}]"
        if not isinstance(row, Mapping):
            raise _fix(f"{where}={row!r} is not an object.")
        for field, kind in ROW_FIELDS.items():
            if field not in row:
                raise _fix(f"{where} has no `{field}`.")
            v = row[field]
            if kind is str and (not isinstance(v, str) or not v.strip()):
                raise _fix(f"{where}.{field}={v!r} must be a non-empty string.")
            if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v <= 0):
                raise _fix(f"{where}.{field}={v!r} must be a finite number > 0.")
            if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise _fix(f"{where}.{field}={v!r} must be an integer >= 1.")
        if row["corunner"] == "none":
            raise _fix(f"{where}.corunner='none' is the solo run, which is not a row (its slowdown is 1).")
        key = (row["workload"], row["device"], row["corunner"])
        ratios = row.get("ratios")
        if ratios is not None and (not isinstance(ratios, list) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                for r in ratios)):
            raise _fix(f"{where}.ratios={ratios!r} must be a list of numbers > 0 (one per repeat), or absent.")
        if key in seen:
            raise _fix(f"{where} repeats (workload, device, corunner)={key}; each pair appears once.")
        seen.add(key)
    return dict(table)


def load_table(path: str | Path | None = None) -> dict[str, Any]:
    """Read and validate a table file (``None``: the shipped ``models/interference_cpu.json``)."""
    data, label = read_shipped_or_file(
        path, "hetero_plugins.scheduler", f"models/{SHIPPED_TABLE}", "path",
        "write one with `hetero-plugins profile-interference --out FILE`, or pass None for the shipped table.",
        what="table")
    text = data.decode("utf-8")
    try:
        table = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{label} is not JSON ({err}). HINT: write tables with `hetero-plugins "
                         "profile-interference`.") from err
    return validate_table(table, label)


def table_slowdowns(table: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """``{(workload, corunner): slowdown}`` (a table of several devices: use :func:`table_samples`)."""
    return {(r["workload"], r["corunner"]): float(r["slowdown"]) for r in table["rows"]}


def table_samples(table: Mapping[str, Any]) -> list[tuple[str, str, str, float]]:
    """The rows as the NCF's ``(workload, device, corunner, slowdown)`` samples."""
    return [(r["workload"], r["device"], r["corunner"], float(r["slowdown"])) for r in table["rows"]]


def format_table(table: Mapping[str, Any]) -> str:
    """A Markdown table of the slowdowns, workloads by co-runners (one block per device)."""
    lines = []
    for dev in sorted({r["device"] for r in table["rows"]}):
        rows = [r for r in table["rows"] if r["device"] == dev]
        ws = list(dict.fromkeys(r["workload"] for r in rows))
        cs = list(dict.fromkeys(r["corunner"] for r in rows))
        s = {(r["workload"], r["corunner"]): r["slowdown"] for r in rows}
        solo = {r["workload"]: r["solo_s"] for r in rows}
        lines += [f"slowdown on {dev} (shared / solo step time)", "",
                  "| workload | solo ms/step | " + " | ".join(cs) + " |", "|---|---|" + "---|" * len(cs)]
        lines += [f"| {w} | {1e3 * solo[w]:.2f} | " + " | ".join(
            f"{s[(w, c)]:.2f}" if (w, c) in s else "-" for c in cs) + " |" for w in ws]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ models
def additive_baseline(samples: Sequence[tuple[str, str, str, float]]) -> Any:
    """Least-squares ``log s = mu + a[workload] + b[(device, corunner)]``; returns ``predict(w, d, c) -> s``
    (at least 1; an unseen name contributes 0)."""
    ws = sorted({w for w, *_ in samples})
    its = sorted({(d, c) for _, d, c, _ in samples})
    x = np.zeros((len(samples), 1 + len(ws) + len(its)))
    for k, (w, d, c, _) in enumerate(samples):
        x[k, 0], x[k, 1 + ws.index(w)], x[k, 1 + len(ws) + its.index((d, c))] = 1, 1, 1
    y = np.log([max(s, 1e-9) for *_, s in samples])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    a = dict(zip(ws, coef[1:1 + len(ws)]))
    b = dict(zip(its, coef[1 + len(ws):]))

    def predict(w: str, d: str, c: str) -> float:
        return float(max(1.0, math.exp(coef[0] + a.get(w, 0.0) + b.get((d, c), 0.0))))
    return predict


def _fit_ncf(samples: Sequence[tuple[str, str, str, float]], workloads: Sequence[str], devices: Sequence[str],
             corunners: Sequence[str], seed: int, settings: Mapping[str, Any]) -> InterferencePredictor:
    p = InterferencePredictor(workloads, devices, corunners, dim=settings["dim"], tower=settings["tower"], seed=seed)
    p.fit(list(samples), epochs=settings["epochs"], lr=settings["lr"], weight_decay=settings["weight_decay"])
    return p


def _vocab(samples: Sequence[tuple[str, str, str, float]]) -> tuple[list[str], list[str], list[str]]:
    return (sorted({w for w, *_ in samples}), sorted({d for _, d, _, _ in samples}),
            sorted({c for _, _, c, _ in samples}))


def train_ncf(table: Mapping[str, Any], seed: int = 0, out: str | Path | None = None,
              settings: Mapping[str, Any] | None = None) -> tuple[InterferencePredictor, dict[str, Any]]:
    """Train the NCF (settings: :data:`NCF_SETTINGS`, updated by ``settings``) on every row of ``table``.

    Returns the predictor and its statistics (training mean relative error, rows, machine).
    """
    validate_table(table)
    st = {**NCF_SETTINGS, **(settings or {})}
    samples = table_samples(table)
    p = _fit_ncf(samples, *_vocab(samples), seed=seed, settings=st)
    stats = {"rows": len(samples), "train_mean_rel_error": _mre(p, samples), "seed": seed,
             "machine": table["machine"].get("cpu"), "device": table["device"],
             "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in st.items()}}
    if out is not None:
        p.save(out, trained=stats, table_machine=dict(table["machine"]))
    return p, stats


def _mre(model: Any, samples: Sequence[tuple[str, str, str, float]]) -> float:
    return float(np.mean([abs(model.predict(w, d, c) - s) / s for w, d, c, s in samples]))


def leave_pairs_out(table: Mapping[str, Any], folds: int | None = None, seed: int = 0,
                    settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Hold out (workload, co-runner) pairs, train on the rest, predict them: NCF vs the additive baseline.

    Args:
        table: a measured table.
        folds: split the pairs into this many folds at random (``None``: one pair per fold).
        seed: fold and NCF seed.
        settings: NCF settings overriding :data:`NCF_SETTINGS`.

    Returns:
        ``ncf_mean_rel_error``, ``additive_mean_rel_error`` (``|predicted - measured| / measured``, mean over
        held-out pairs), their maxima, ``pairs``, ``folds`` and per-pair predictions under ``"pairs"``.
    """
    validate_table(table)
    st = {**NCF_SETTINGS, **(settings or {})}
    samples = table_samples(table)
    n = len(samples)
    k = n if folds is None else int(folds)
    if not 2 <= k <= n:
        raise ValueError(f"`folds`={folds!r} must be between 2 and the number of pairs ({n}). HINT: None holds "
                         "out one pair at a time.")
    vocab = _vocab(samples)
    order = np.random.default_rng(seed).permutation(n)
    pred_ncf, pred_add = np.zeros(n), np.zeros(n)
    for f in range(k):
        test = order[f::k]
        held = set(test.tolist())
        train = [samples[i] for i in range(n) if i not in held]
        ncf = _fit_ncf(train, *vocab, seed=seed + f, settings=st)
        add = additive_baseline(train)
        for i in test:
            w, d, c, _ = samples[i]
            pred_ncf[i], pred_add[i] = ncf.predict(w, d, c), add(w, d, c)
    true = np.array([s for *_, s in samples])
    e_ncf, e_add = np.abs(pred_ncf - true) / true, np.abs(pred_add - true) / true
    return {"ncf_mean_rel_error": float(e_ncf.mean()), "additive_mean_rel_error": float(e_add.mean()),
            "ncf_max_rel_error": float(e_ncf.max()), "additive_max_rel_error": float(e_add.max()),
            "measurement_rel_se": measurement_noise(table), "mean_slowdown": float(true.mean()),
            "pairs_count": n, "folds": k, "seed": seed,
            "settings": {kk: (list(v) if isinstance(v, tuple) else v) for kk, v in st.items()},
            "pairs": [{"workload": w, "device": d, "corunner": c, "measured": s, "ncf": float(pn),
                       "additive": float(pa)} for (w, d, c, s), pn, pa in zip(samples, pred_ncf, pred_add)]}


def measurement_noise(table: Mapping[str, Any]) -> float | None:
    """Mean relative standard error of the measured slowdowns, from the spread of each row's ``ratios``
    (``None`` without them): no predictor can be expected to err less on held-out pairs."""
    se = [float(np.std(np.log(r["ratios"]), ddof=1) / math.sqrt(len(r["ratios"])))
          for r in table["rows"] if len(r.get("ratios") or []) >= 2]
    return float(np.mean(np.expm1(se))) if se else None


def load_measured_predictor(path: str | Path | None = None) -> InterferencePredictor:
    """The NCF trained on a measured table (``None``: the shipped ``models/ncf_measured_cpu.npz``)."""
    return InterferencePredictor.load(path, shipped=MEASURED_MODEL)
