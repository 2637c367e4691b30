"""Stage 1 (LDWP): a Double DQN that assigns chunks of the global batch to ranks.

Zhang, Geng, Ma ("Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster", IEEE TPDS 2021) schedule independent tasks onto nodes with a deep Q-network learned
from cluster status and task features, pre-trained before it runs. The paper's state, action and reward
are not public; this reconstruction follows DeepRM-style designs (Mao et al., HotNets 2016):

- **Episode**: one planning decision. The global batch, less every rank's minimum, is cut into chunks that
  are assigned one at a time (tasks in order, as in the patent's task queue).
- **Action**: the rank that gets the next chunk. A shared-weight MLP scores every rank from its own features
  (:mod:`hetero_plugins.scheduler.features`); ranks without memory headroom are masked out.
- **Reward**: minus the chunk's completion time on that rank (the rank's *true* next-epoch step time after
  the chunk, data time included) over ``T``, minus the increase of the true makespan. During pre-training
  the truth comes from the simulator's next epoch, so the network learns what the fitted time lines miss
  (trends, input-pipeline time) rather than re-deriving the closed form.
- **Learning**: experience replay, a target network synced every ``target_sync`` updates, epsilon-greedy
  exploration, Double DQN targets ``r + gamma * Q_target(s', argmax_a Q(s', a))`` (van Hasselt et al. 2016).

Inference is numpy only and incremental (only the ranks that received a chunk are re-scored). For large
clusters it runs coarse-to-fine: chunks of about ``free / (chunks_per_rank * N)`` samples are handed to the
top ``N / parallel`` ranks per scoring round until about one chunk per rank is left, then the chunk is halved,
down to single samples, so plans keep single-sample precision in about 10 ms at 1024 ranks.
"""

from __future__ import annotations

import copy
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.scheduler.features import (
    FEATURES,
    DecisionContext,
    mlp_arrays,
    mlp_forward,
    mlp_from_arrays,
    mlp_random,
    read_model,
    write_model,
)

__all__ = ["DQNTrainer", "QNetwork", "assign"]

DEFAULT_MODEL = "dqn_v1.npz"


class QNetwork:
    """The per-rank scorer: an MLP ``features -> Q`` in numpy (float32), shared by every rank.

    Args:
        layers: ``[(W, b), ...]``; ReLU between layers, a linear last layer with one output.

    Example::

        >>> net = QNetwork.random(seed=0)
        >>> net(np.zeros((3, len(FEATURES)))).shape
        (3,)
    """

    def __init__(self, layers: Sequence[tuple[np.ndarray, np.ndarray]], meta: dict[str, Any] | None = None) -> None:
        self.layers = [(np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32)) for w, b in layers]
        if self.layers[0][0].shape[0] != len(FEATURES) or self.layers[-1][0].shape[1] != 1:
            raise ValueError(
                f"a Q-network must map {len(FEATURES)} features to 1 score, got layer shapes "
                f"{[w.shape for w, _ in self.layers]}. HINT: build it with QNetwork.random() or DQNTrainer."
            )
        self.meta = dict(meta or {})

    @classmethod
    def random(cls, hidden: Sequence[int] = (32, 32), seed: int = 0) -> QNetwork:
        """An untrained network (He-initialised), e.g. a baseline or a starting point."""
        return cls(mlp_random([len(FEATURES), *hidden, 1], seed))

    @classmethod
    def load(cls, path: str | Path | None = None) -> QNetwork:
        """Load a model file (``None``: the shipped default); refuses another feature schema."""
        arrays, meta = read_model(path, "dqn", DEFAULT_MODEL)
        return cls(mlp_from_arrays(arrays), meta)

    def save(self, path: str | Path, **meta: Any) -> Path:
        """Write the weights and a metadata header (feature schema version, ``meta``)."""
        return write_model(path, mlp_arrays(self.layers), {**self.meta, **meta, "kind": "dqn"})

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return mlp_forward(self.layers, x, np.float32)


def _chunk_size(free: int, world: int, chunks_per_rank: int) -> int:
    return max(1, free // max(1, chunks_per_rank * world))


def assign(
    net: QNetwork | Callable[[np.ndarray], np.ndarray],
    ctx: DecisionContext,
    min_batch: Sequence[int],
    chunks_per_rank: int = 2,
    parallel: int = 4,
) -> list[int]:
    """Greedy chunk assignment by the network's scores; returns per-rank batch sizes summing to the global batch.

    Args:
        net: the scorer (feature rows -> one score per row).
        ctx: the decision's per-rank constants.
        min_batch: each rank's minimum local batch (given before any chunk).
        chunks_per_rank: coarse chunks per rank on average (chunk size ~ free / (chunks_per_rank * N)).
        parallel: ranks per round = ``max(1, N // parallel)``; 1 rank per round is exact greedy.
    """
    n = ctx.world_size
    load = np.asarray(min_batch, dtype=np.float64).copy()
    hi = ctx.max_batch
    free = int(ctx.global_batch - load.sum())
    per_round = max(1, n // max(1, parallel))
    # Coarse to fine: each phase hands out chunks until about one chunk per rank is left, the next phase
    # halves the chunk; the last phase hands out single samples.
    chunk = _chunk_size(free, n, chunks_per_rank)
    phases = []
    while chunk > 1:
        phases.append(chunk)
        chunk //= 2
    phases.append(1)
    all_idx = np.arange(n)
    for chunk in phases:
        reserve = 0 if chunk == 1 else n * chunk
        budget = free - reserve  # samples to hand out in this phase
        if budget <= 0:
            continue
        scores = net(ctx.features(all_idx, load, chunk)).astype(np.float64)
        scores[load + chunk > hi] = -np.inf
        while budget >= chunk or (chunk == 1 and budget > 0):
            k = min(per_round, budget // chunk, int(np.isfinite(scores).sum()))
            if k <= 0:
                break
            top = np.argpartition(-scores, k - 1)[:k] if k < n else all_idx
            top = top[np.isfinite(scores[top])]
            load[top] += chunk
            budget -= chunk * len(top)
            free -= chunk * len(top)
            scores[top] = net(ctx.features(top, load, chunk))
            scores[top[load[top] + chunk > hi[top]]] = -np.inf
    if free > 0:  # every rank at its cap in the last phase cannot happen when bounds are feasible; be safe
        room = hi - load
        for i in np.argsort(-room):
            give = int(min(room[i], free))
            load[i] += give
            free -= give
    return np.rint(load).astype(np.int64).tolist()


def _true_times(p: Any, load: np.ndarray) -> np.ndarray:
    return p.true_intercept + p.true_slope * load + p.true_data


class DQNTrainer:
    """Double DQN with replay, a target network and epsilon-greedy exploration, over decision problems.

    Args:
        net: starting weights (``None``: random).
        lr: Adam learning rate.
        gamma: discount between chunk decisions.
        batch_size: replay minibatch.
        replay_size: replay capacity (transitions).
        target_sync: updates between target-network copies.
        eps_start, eps_end, eps_decay: exploration rate, decayed linearly over ``eps_decay`` episodes.
        chunks_per_rank: chunks per rank in training episodes.
        makespan_weight: weight of the makespan-increase term of the reward.
        seed: seeds exploration and initialisation.
    """

    def __init__(
        self,
        net: QNetwork | None = None,
        lr: float = 1e-3,
        gamma: float = 0.5,
        batch_size: int = 64,
        replay_size: int = 20000,
        target_sync: int = 100,
        eps_start: float = 0.5,
        eps_end: float = 0.02,
        eps_decay: int = 200,
        chunks_per_rank: int = 8,
        makespan_weight: float = 1.0,
        seed: int = 0,
    ) -> None:
        import torch

        torch.manual_seed(seed)
        self.torch = torch
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        net = net or QNetwork.random(seed=seed)
        self.online = self._to_torch(net)
        self.target = copy.deepcopy(self.online)
        self.opt = torch.optim.Adam(self.online.parameters(), lr=lr)
        self.gamma, self.batch_size, self.target_sync = gamma, batch_size, target_sync
        self.eps_start, self.eps_end, self.eps_decay = eps_start, eps_end, eps_decay
        self.chunks_per_rank, self.makespan_weight = chunks_per_rank, makespan_weight
        self.replay: deque[tuple[np.ndarray, float, np.ndarray, np.ndarray, bool]] = deque(maxlen=replay_size)
        self.episodes = 0
        self.updates = 0
        self.meta = dict(net.meta)
        self._np = self.network()

    def _to_torch(self, net: QNetwork) -> Any:
        torch = self.torch
        mods: list[Any] = []
        for i, (w, b) in enumerate(net.layers):
            lin = torch.nn.Linear(w.shape[0], w.shape[1])
            with torch.no_grad():
                lin.weight.copy_(torch.as_tensor(w.T))
                lin.bias.copy_(torch.as_tensor(b))
            mods.append(lin)
            if i < len(net.layers) - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)

    def network(self) -> QNetwork:
        """The online network as a numpy :class:`QNetwork`."""
        lins = [m for m in self.online if isinstance(m, self.torch.nn.Linear)]
        return QNetwork([(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()) for m in lins], self.meta)

    def freeze_lower(self, frozen: bool) -> None:
        """Freeze (or unfreeze) every layer but the last (transfer learning's first phase)."""
        lins = [m for m in self.online if isinstance(m, self.torch.nn.Linear)]
        for m in lins[:-1]:
            for p in m.parameters():
                p.requires_grad_(not frozen)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    @property
    def epsilon(self) -> float:
        frac = min(1.0, self.episodes / max(1, self.eps_decay))
        return self.eps_start + (self.eps_end - self.eps_start) * frac

    def run_episode(self, problem: Any, learn: bool = True, updates_per_step: float = 0.25) -> float:
        """Assign one decision problem chunk by chunk (epsilon-greedy), store transitions, learn.

        Returns the true makespan reached (seconds).
        """
        ctx = DecisionContext(problem.intercept, problem.slope, problem.global_batch, problem.max_batch,
                              prev_slope=problem.prev_slope, utilisation=problem.utilisation, data=problem.data)
        n = ctx.world_size
        load = np.ones(n)
        free = int(problem.global_batch - n)
        chunk = _chunk_size(free, n, self.chunks_per_rank)
        all_idx = np.arange(n)
        eps = self.epsilon if learn else 0.0
        makespan = float(np.max(_true_times(problem, load)))
        pending = 0.0
        while free > 0:
            c = min(chunk, free)
            feats = ctx.features(all_idx, load, c)
            valid = load + c <= ctx.max_batch
            if not valid.any():
                break
            if self.rng.random() < eps:
                a = int(self.rng.choice(list(np.flatnonzero(valid))))
            else:
                s = self._np(feats)
                s[~valid] = -np.inf
                a = int(np.argmax(s))
            load[a] += c
            free -= c
            t_after = float(problem.true_intercept[a] + problem.true_slope[a] * load[a] + problem.true_data[a])
            new_makespan = max(makespan, t_after)
            r = -(t_after + self.makespan_weight * (new_makespan - makespan)) / ctx.T
            makespan = new_makespan
            if learn:
                c2 = min(chunk, free) if free > 0 else c
                nxt = ctx.features(all_idx, load, c2)
                nvalid = load + c2 <= ctx.max_batch
                self.replay.append((feats[a].astype(np.float32), r, nxt.astype(np.float32), nvalid, free <= 0))
                pending += updates_per_step
                while pending >= 1.0:
                    self.update()
                    pending -= 1.0
        if learn:
            self.episodes += 1
            self._np = self.network()
        return makespan

    def update(self) -> float | None:
        """One Double-DQN minibatch update; returns the loss (``None`` while the replay is too small)."""
        if len(self.replay) < self.batch_size:
            return None
        torch = self.torch
        batch = self.rng.sample(list(self.replay), self.batch_size) if len(self.replay) < 4 * self.batch_size else [
            self.replay[i] for i in self.np_rng.integers(0, len(self.replay), self.batch_size)]
        nmax = max(len(b[2]) for b in batch)
        f = len(FEATURES)
        x = torch.as_tensor(np.stack([b[0] for b in batch]))
        r = torch.as_tensor([b[1] for b in batch], dtype=torch.float32)
        nxt = np.zeros((len(batch), nmax, f), dtype=np.float32)
        mask = np.zeros((len(batch), nmax), dtype=bool)
        for i, b in enumerate(batch):
            nxt[i, : len(b[2])] = b[2]
            mask[i, : len(b[3])] = b[3]
        done = torch.as_tensor([b[4] for b in batch], dtype=torch.float32)
        nxt_t, mask_t = torch.as_tensor(nxt), torch.as_tensor(mask)
        with torch.no_grad():
            q_online = self.online(nxt_t).squeeze(-1).masked_fill(~mask_t, -1e9)
            best = q_online.argmax(dim=1, keepdim=True)
            q_target = self.target(nxt_t).squeeze(-1).gather(1, best).squeeze(1)
            no_action = ~mask_t.any(dim=1)
            y = r + self.gamma * (1.0 - done) * torch.where(no_action, torch.zeros_like(q_target), q_target)
        q = self.online(x).squeeze(-1)
        loss = torch.nn.functional.smooth_l1_loss(q, y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.updates += 1
        if self.updates % self.target_sync == 0:
            self.target.load_state_dict(self.online.state_dict())
        return float(loss.detach())

    def train(self, problems: Sequence[Any], seconds: float | None = None, episodes: int | None = None,
              log_every: int = 0, lr_end: float | None = None) -> dict[str, Any]:
        """Run episodes over ``problems`` (cycled, shuffled) until ``episodes`` or ``seconds`` run out.

        ``lr_end``: decay the learning rate linearly to this value over the budget (stabilises the end).
        """
        if not problems:
            raise ValueError("`problems` is empty. HINT: build some with hetero_plugins.scheduler.sim.decision_problems().")
        t0 = time.perf_counter()
        order = list(range(len(problems)))
        k = 0
        done = 0
        lr0 = self.opt.param_groups[0]["lr"]
        while (episodes is None or done < episodes) and (seconds is None or time.perf_counter() - t0 < seconds):
            if k % len(order) == 0:
                self.rng.shuffle(order)
            if lr_end is not None:
                frac = done / episodes if episodes else (time.perf_counter() - t0) / float(seconds or 1.0)
                self.set_lr(lr0 + (lr_end - lr0) * min(1.0, frac))
            self.run_episode(problems[order[k % len(order)]])
            k += 1
            done += 1
            if log_every and done % log_every == 0:
                print(f"episode {done} eps {self.epsilon:.2f} updates {self.updates} {time.perf_counter() - t0:.0f}s")
        return {"episodes": done, "updates": self.updates, "seconds": time.perf_counter() - t0}
