"""Per-rank features of the stage-1 scheduler, and the model-file format that pins their schema.

The DQN of LDWP (Zhang, Geng, Ma, IEEE TPDS 2021) maps "cluster runtime status" and "task characteristics"
to a scheduling action. Here a task is a chunk of the global batch and an action a rank; one shared-weight
network scores every rank from that rank's own features, so the same weights serve any world size (no
output head per rank to re-initialise when the cluster changes). The features (schema
:data:`FEATURE_SCHEMA_VERSION`), normalised by the ideal equal-finish step time ``T``:

==================  ================================================================================
``t_now``           predicted compute time at the rank's current load, / T
``t_next``          the same after one more chunk, / T
``chunk_cost``      the chunk's predicted cost on this rank, / T
``intercept_share`` fixed cost / predicted time at the mean load (how little a smaller batch saves)
``log_speed``       log of the rank's throughput relative to the mean (1/slope)
``trend``           log of slope now / slope at the previous decision, clipped to [-1, 1]
``utilisation``     share of the device used by other processes (0: dedicated)
``headroom``        free memory in local-batch units, (max_batch - load) / mean load, clipped to [0, 4]
``data``            seconds per step outside the measured compute window (input pipeline), / T
``load_share``      current load / mean load
==================  ================================================================================

Features depend only on the rank's own state and decision-wide constants, so after a chunk is assigned
only that rank's row changes: large clusters are scored incrementally.

Model files are ``.npz`` archives holding the weights and a ``meta`` JSON header (``kind``,
``schema_version``, ``features``...); :func:`read_model` refuses a file built for another schema.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._files import read_shipped_or_file, write_atomic

__all__ = ["FEATURES", "FEATURE_SCHEMA_VERSION", "DecisionContext", "mlp_arrays", "mlp_fit", "mlp_forward",
           "mlp_from_arrays", "mlp_random", "read_model", "write_model"]

FEATURE_SCHEMA_VERSION = 1
FEATURES: tuple[str, ...] = (
    "t_now", "t_next", "chunk_cost", "intercept_share", "log_speed", "trend", "utilisation", "headroom",
    "data", "load_share",
)


@dataclass
class DecisionContext:
    """Decision-wide per-rank constants from which :meth:`features` builds rows.

    Args:
        intercept, slope: each rank's fitted time line (seconds, seconds per sample).
        global_batch: samples to split.
        max_batch: each rank's cap.
        prev_slope: slopes at the previous decision (``None``: no trend known).
        utilisation: per-rank utilisation by other processes (``None``: 0).
        data: per-rank data seconds per step (``None``: 0).
    """

    intercept: np.ndarray
    slope: np.ndarray
    global_batch: int
    max_batch: np.ndarray
    prev_slope: np.ndarray | None = None
    utilisation: np.ndarray | None = None
    data: np.ndarray | None = None

    def __post_init__(self) -> None:
        a = np.maximum(np.asarray(self.intercept, dtype=np.float64), 0.0)
        beta = np.maximum(np.asarray(self.slope, dtype=np.float64), 1e-12)
        n = len(a)
        self.intercept, self.slope = a, beta
        self.max_batch = np.asarray(self.max_batch, dtype=np.float64)
        self.mean_load = self.global_batch / n
        #: The ideal (unbounded, continuous) equal-finish step time: the normaliser of every time feature.
        self.T = float((self.global_batch + np.sum(a / beta)) / np.sum(1.0 / beta))
        speed = 1.0 / beta
        self._static = np.zeros((n, 6))
        self._static[:, 0] = a / (a + beta * self.mean_load)
        self._static[:, 1] = np.clip(np.log(speed / speed.mean()), -4.0, 4.0)
        if self.prev_slope is not None and len(self.prev_slope) == n:
            self._static[:, 2] = np.clip(np.log(beta / np.maximum(np.asarray(self.prev_slope, dtype=np.float64), 1e-12)), -1.0, 1.0)
        if self.utilisation is not None:
            self._static[:, 3] = np.clip(np.asarray(self.utilisation, dtype=np.float64), 0.0, 1.0)
        if self.data is not None:
            self._static[:, 5] = np.maximum(np.asarray(self.data, dtype=np.float64), 0.0) / self.T

    @property
    def world_size(self) -> int:
        return len(self.intercept)

    def features(self, idx: np.ndarray, load: np.ndarray, chunk: float) -> np.ndarray:
        """Feature rows (schema :data:`FEATURES`) of ranks ``idx`` at loads ``load[idx]``, for chunks of ``chunk``."""
        a, beta, T = self.intercept[idx], self.slope[idx], self.T
        ld = load[idx]
        st = self._static[idx]
        out = np.empty((len(idx), len(FEATURES)))
        out[:, 0] = (a + beta * ld) / T
        out[:, 1] = (a + beta * (ld + chunk)) / T
        out[:, 2] = beta * chunk / T
        out[:, 3] = st[:, 0]
        out[:, 4] = st[:, 1]
        out[:, 5] = st[:, 2]
        out[:, 6] = st[:, 3]
        out[:, 7] = np.clip((self.max_batch[idx] - ld) / self.mean_load, 0.0, 4.0)
        out[:, 8] = st[:, 5]
        out[:, 9] = ld / self.mean_load
        return out


Layers = list[tuple[np.ndarray, np.ndarray]]


def mlp_random(sizes: Sequence[int], seed: int, out_scale: float = 1.0) -> Layers:
    """He-initialised ``[(W, b), ...]`` for an MLP with layer widths ``sizes`` (zero biases); the output layer's
    weights times ``out_scale`` (e.g. 0.01: a network that starts near zero everywhere)."""
    rng = np.random.default_rng(seed)
    layers = [(rng.normal(0, math.sqrt(2.0 / i), (i, o)), np.zeros(o)) for i, o in zip(sizes[:-1], sizes[1:])]
    layers[-1] = (layers[-1][0] * out_scale, layers[-1][1])
    return layers


def mlp_forward(layers: Layers, x: np.ndarray, dtype: Any) -> np.ndarray:
    """The MLP's one output per row of ``x``: ReLU between layers, a linear last layer, computed in ``dtype``."""
    h = np.asarray(x, dtype=dtype)
    for w, b in layers[:-1]:
        h = np.maximum(h @ w + b, 0.0)
    w, b = layers[-1]
    return (h @ w + b)[:, 0]


def mlp_fit(layers: Layers, x: np.ndarray, y: np.ndarray, steps: int = 2000, lr: float = 1e-3, batch: int = 128,
            seed: int = 0, weight_decay: float = 1e-5, state: dict[str, Any] | None = None) -> float:
    """Fit the MLP ``layers`` in place by Adam on the Huber loss towards ``y`` (numpy backpropagation, minibatches of
    ``batch`` rows drawn with ``seed``, L2 ``weight_decay``); returns the last minibatch's mean loss. ``state`` carries
    Adam's moments between calls (online updates)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    st = state if state is not None else {}
    if "m" not in st:
        st["m"] = [(np.zeros_like(w), np.zeros_like(b)) for w, b in layers]
        st["v"] = [(np.zeros_like(w), np.zeros_like(b)) for w, b in layers]
        st["t"] = 0
    b1, b2, eps = 0.9, 0.999, 1e-8
    loss = 0.0
    for _ in range(int(steps)):
        idx = rng.integers(0, len(x), min(batch, len(x)))
        xb, yb = x[idx], y[idx]
        acts = [xb]
        h = xb
        for w, b in layers[:-1]:
            h = np.maximum(h @ w + b, 0.0)
            acts.append(h)
        w, b = layers[-1]
        out = (h @ w + b)[:, 0]
        err = out - yb
        loss = float(np.mean(np.where(np.abs(err) < 1.0, 0.5 * err ** 2, np.abs(err) - 0.5)))
        g = (np.clip(err, -1.0, 1.0) / len(xb))[:, None]
        grads = []
        for li in range(len(layers) - 1, -1, -1):
            w, b = layers[li]
            a = acts[li]
            grads.append((a.T @ g + weight_decay * w, g.sum(0)))
            if li > 0:
                g = (g @ w.T) * (acts[li] > 0)
        grads.reverse()
        st["t"] += 1
        t = st["t"]
        for li, ((w, b), (gw, gb)) in enumerate(zip(layers, grads)):
            (mw, mb), (vw, vb) = st["m"][li], st["v"][li]
            mw[:] = b1 * mw + (1 - b1) * gw
            mb[:] = b1 * mb + (1 - b1) * gb
            vw[:] = b2 * vw + (1 - b2) * gw ** 2
            vb[:] = b2 * vb + (1 - b2) * gb ** 2
            c1, c2 = 1 - b1 ** t, 1 - b2 ** t
            w -= lr * (mw / c1) / (np.sqrt(vw / c2) + eps)
            b -= lr * (mb / c1) / (np.sqrt(vb / c2) + eps)
    return loss


def mlp_arrays(layers: Layers) -> dict[str, np.ndarray]:
    """The layers as the arrays :func:`write_model` stores (``W0``, ``b0``, ``W1``, ...)."""
    arrays: dict[str, np.ndarray] = {}
    for i, (w, b) in enumerate(layers):
        arrays[f"W{i}"], arrays[f"b{i}"] = w, b
    return arrays


def mlp_from_arrays(arrays: dict[str, np.ndarray]) -> Layers:
    """The layers back from :func:`mlp_arrays`' arrays (as :func:`read_model` returns them)."""
    return [(arrays[f"W{i}"], arrays[f"b{i}"]) for i in range(len([k for k in arrays if k.startswith("W")]))]


def write_model(path: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Save ``arrays`` (float32) and a ``meta`` JSON header (schema version and features added) as ``.npz``,
    atomically (:func:`~hetero_plugins._files.write_atomic`: an interrupted write leaves the old file)."""
    path = Path(path)
    meta = {"schema_version": FEATURE_SCHEMA_VERSION, "features": list(FEATURES), **meta}
    payload = {k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta)), **payload)
    return write_atomic(path, buf.getvalue())


def read_model(source: str | Path | None, kind: str, default: str, features: Sequence[str] | None = None,
               feature_key: str = "features", rebuild: str = "`hetero-plugins pretrain`",
               ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Load a model file written by :func:`write_model`; ``None`` loads the shipped ``default`` resource.

    Args:
        source: the file, or ``None`` for the shipped one.
        kind: the model kind its metadata must name.
        default: the shipped file's name under ``hetero_plugins/scheduler/models``.
        features: the feature list its metadata must hold under ``feature_key`` (``None``: not checked; the
            ``dqn`` kind always checks :data:`FEATURES` and the schema version).
        rebuild: the command the error names to rebuild a file built for other features.

    Raises:
        ValueError: the file is missing, is not a ``kind`` model, or was built for another feature schema.
    """
    data, label = read_shipped_or_file(
        source, "hetero_plugins.scheduler", f"models/{default}", "model",
        "pass a file written by `hetero-plugins pretrain` / `transfer`, or model=None for the shipped default.",
        what="model" if source is None else "model file")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k], dtype=np.float64) for k in z.files if k != "meta"}
            meta = json.loads(str(z["meta"]))
    except Exception as err:  # noqa: BLE001 - any unreadable archive gets the same advice
        raise ValueError(f"{label} is not a hetero_plugins scheduler model ({err}). "
                         "HINT: pass a file written by `hetero-plugins pretrain`.") from err
    if meta.get("kind") != kind:
        raise ValueError(f"{label} holds a {meta.get('kind')!r} model, expected {kind!r}. "
                         f"HINT: pass a {kind} model file.")
    if kind == "dqn" and (meta.get("schema_version") != FEATURE_SCHEMA_VERSION or meta.get("features") != list(FEATURES)):
        raise ValueError(
            f"{label} was built for feature schema version {meta.get('schema_version')!r} "
            f"(features {meta.get('features')}), but this hetero_plugins uses version {FEATURE_SCHEMA_VERSION} "
            f"(features {list(FEATURES)}). HINT: rebuild it with `hetero-plugins pretrain` (or `transfer` from the "
            "shipped model), or pass model=None to use the shipped default."
        )
    if features is not None and meta.get(feature_key) != list(features):
        raise ValueError(f"{label} was built for features {meta.get(feature_key)}, this version uses "
                         f"{list(features)}. HINT: rebuild it with {rebuild}, or load the shipped one (path None).")
    return arrays, meta
