"""Stage 2 (IAWP): a NeuMF interference predictor.

Zhang, Geng, Ma (IEEE TPDS 2021) place co-executing subtasks with neural collaborative filtering. The
equivalent used here is NeuMF (He et al., "Neural Collaborative Filtering", WWW 2017): a GMF branch (the
element-wise product of a "user" and an "item" embedding) and an MLP branch (their concatenation through a
tower) joined by a linear output. The user is the workload type; the item is a (device type, co-runner)
pair; the output, regressed with MSE, is the log of the slowdown ``t_corun / t_solo`` (>= 0 via softplus).
Pre-training follows the NeuMF recipe: GMF and MLP are trained alone, then NeuMF is initialised from both
with the two predictive layers weighted by ``alpha = 0.5`` and trained jointly.

Its predictions reach the scheduler through
:class:`~hetero_plugins.scheduler.interference.InterferenceCorrection`: the learned allocators correct fitted
time lines with them, and the :class:`~hetero_plugins.scheduler.relocation.Relocator` prices slots with them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.scheduler.features import read_model, write_model

__all__ = ["InterferencePredictor"]

DEFAULT_MODEL = "ncf_v1.npz"
SOLO = "none"


def _build(n_users: int, n_items: int, dim: int, tower: Sequence[int]) -> Any:
    import torch
    from torch import nn

    class NeuMF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gmf_u, self.gmf_i = nn.Embedding(n_users, dim), nn.Embedding(n_items, dim)
            self.mlp_u, self.mlp_i = nn.Embedding(n_users, dim), nn.Embedding(n_items, dim)
            layers: list[nn.Module] = []
            width = 2 * dim
            for h in tower:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            self.tower = nn.Sequential(*layers)
            self.out_gmf, self.out_mlp = nn.Linear(dim, 1), nn.Linear(width, 1)
            for e in (self.gmf_u, self.gmf_i, self.mlp_u, self.mlp_i):
                nn.init.normal_(e.weight, std=0.3)

        def forward(self, u: torch.Tensor, i: torch.Tensor, mode: str = "neumf") -> torch.Tensor:
            g = self.out_gmf(self.gmf_u(u) * self.gmf_i(i)).squeeze(-1)
            m = self.out_mlp(self.tower(torch.cat([self.mlp_u(u), self.mlp_i(i)], dim=-1))).squeeze(-1)
            z = g if mode == "gmf" else m if mode == "mlp" else g + m
            return nn.functional.softplus(z)  # log-slowdown >= 0

    return NeuMF()


class InterferencePredictor:
    """Predicts the slowdown of a workload on a device type beside a co-runner (``"none"``: solo, 1.0).

    Args:
        workloads: workload names (NCF users).
        devices: device type names.
        corunners: co-runner names; ``"none"`` is added.
        dim: embedding size of each branch.
        tower: MLP tower widths.
        seed: initialisation seed.

    Example::

        >>> p = InterferencePredictor(["train"], ["gpu"], ["video"])
        >>> _ = p.fit([("train", "gpu", "video", 1.5), ("train", "gpu", "none", 1.0)], epochs=200)
        >>> round(p.predict("train", "gpu", "video"), 1)
        1.5
    """

    def __init__(self, workloads: Sequence[str], devices: Sequence[str], corunners: Sequence[str],
                 dim: int = 8, tower: Sequence[int] = (32, 16, 8), seed: int = 0) -> None:
        import torch

        torch.manual_seed(seed)
        self.workloads, self.devices = list(workloads), list(devices)
        self.corunners = [SOLO] + [c for c in corunners if c != SOLO]
        self.dim, self.tower = int(dim), tuple(int(h) for h in tower)
        self.model = _build(len(self.workloads), len(self.devices) * len(self.corunners), self.dim, self.tower)
        self.meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ indexing
    def _ids(self, rows: Sequence[tuple[str, str, str | None]]) -> tuple[Any, Any]:
        import torch

        u, i = [], []
        for w, d, c in rows:
            for name, vocab, field in ((w, self.workloads, "workload"), (d, self.devices, "device")):
                if name not in vocab:
                    raise ValueError(f"unknown {field} {name!r}; this predictor knows {vocab}. HINT: extend it "
                                     "to new names with transfer_ncf (hetero_plugins.scheduler.transfer).")
            c = SOLO if c is None else c
            if c not in self.corunners:
                raise ValueError(f"unknown co-runner {c!r}; this predictor knows {self.corunners}. "
                                 "HINT: extend it to new names with transfer_ncf (hetero_plugins.scheduler.transfer).")
            u.append(self.workloads.index(w))
            i.append(self.devices.index(d) * len(self.corunners) + self.corunners.index(c))
        return torch.tensor(u), torch.tensor(i)

    # ------------------------------------------------------------------ training
    def fit(self, samples: Sequence[tuple[str, str, str | None, float]], epochs: int = 300, lr: float = 0.01,
            pretrain_epochs: int | None = None, alpha: float = 0.5, seconds: float | None = None,
            weight_decay: float = 0.0) -> dict[str, float]:
        """Train on ``(workload, device, corunner, slowdown)`` samples: GMF and MLP alone, then NeuMF (alpha fusion).

        ``weight_decay`` (Adam's L2 penalty) keeps embeddings small where a table has only tens of rows
        (measured tables, :mod:`hetero_plugins.scheduler.measured`). Returns the final training MSE of the
        log-slowdown.
        """
        import torch

        torch.set_num_threads(1)
        if not samples:
            raise ValueError("`samples` is empty. HINT: give (workload, device, corunner, slowdown) tuples.")
        u, i = self._ids([(w, d, c) for w, d, c, _ in samples])
        y = torch.tensor([math.log(max(s, 1.0)) for *_, s in samples], dtype=torch.float32)
        t0 = time.perf_counter()
        pre = epochs // 2 if pretrain_epochs is None else pretrain_epochs
        for mode in ("gmf", "mlp"):
            self._train(u, i, y, mode, pre, lr, t0, seconds, weight_decay)
        with torch.no_grad():  # NeuMF initialised from both, predictive layers weighted alpha / 1 - alpha
            self.model.out_gmf.weight.mul_(alpha)
            self.model.out_gmf.bias.mul_(alpha)
            self.model.out_mlp.weight.mul_(1 - alpha)
            self.model.out_mlp.bias.mul_(1 - alpha)
        loss = self._train(u, i, y, "neumf", epochs, lr / 2, t0, seconds, weight_decay)
        return {"mse_log": loss}

    def _train(self, u: Any, i: Any, y: Any, mode: str, epochs: int, lr: float, t0: float,
               seconds: float | None, weight_decay: float = 0.0) -> float:
        import torch

        opt = torch.optim.Adam(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        loss = torch.tensor(float("nan"))
        for _ in range(epochs):
            if seconds is not None and time.perf_counter() - t0 > seconds:
                break
            perm = torch.randperm(len(y))
            for k in range(0, len(y), 256):
                b = perm[k: k + 256]
                loss = torch.nn.functional.mse_loss(self.model(u[b], i[b], mode), y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
        return float(loss.detach())

    def mse(self, samples: Sequence[tuple[str, str, str | None, float]]) -> float:
        """Mean squared error of the predicted log-slowdown on ``samples``."""
        pred = np.log([self.predict(w, d, c) for w, d, c, _ in samples])
        return float(np.mean((pred - np.log([max(s, 1.0) for *_, s in samples])) ** 2))

    # ------------------------------------------------------------------ inference
    def predict(self, workload: str, device: str, corunner: str | None) -> float:
        """Predicted slowdown (>= 1); exactly 1 without a co-runner."""
        return float(self.predict_many([(workload, device, corunner)])[0])

    def predict_many(self, rows: Sequence[tuple[str, str, str | None]]) -> np.ndarray:
        import torch

        u, i = self._ids(rows)
        with torch.no_grad():
            z = self.model(u, i).numpy().astype(np.float64)
        solo = np.array([(c is None or c == SOLO) for _, _, c in rows])
        return np.where(solo, 1.0, np.exp(z))

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, **meta: Any) -> Path:
        arrays = {k: v.detach().numpy() for k, v in self.model.state_dict().items()}
        head = {"kind": "ncf", "workloads": self.workloads, "devices": self.devices, "corunners": self.corunners,
                "dim": self.dim, "tower": list(self.tower), **self.meta, **meta}
        return write_model(path, arrays, head)

    @classmethod
    def load(cls, path: str | Path | None = None, shipped: str = DEFAULT_MODEL) -> InterferencePredictor:
        """Load a saved predictor (``None``: the shipped model file named ``shipped``, by default the one
        pre-trained on the synthetic table; ``"ncf_measured_cpu.npz"`` is the one trained on the measured CPU
        table, see :func:`hetero_plugins.scheduler.measured.load_measured_predictor`)."""
        import torch

        arrays, meta = read_model(path, "ncf", shipped)
        p = cls(meta["workloads"], meta["devices"], meta["corunners"], dim=meta["dim"], tower=meta["tower"])
        p.model.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in arrays.items()})
        p.meta = {k: v for k, v in meta.items() if k not in ("kind", "workloads", "devices", "corunners", "dim",
                                                               "tower", "schema_version", "features")}
        return p
