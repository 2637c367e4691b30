"""Elastic Horovod: the sampler's state handler, slots followed across resets, and relocation by hosts file.

A worker's *slot* is ``"host[local rank]"``. When Horovod replaces a worker (a relocation through the hosts
file, a lost host) the ranks are renumbered, but time models belong to slots: :func:`follow_slots` gives each
rank the model of its slot, and a new slot starts from the line the restart spec predicted for its host.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from hetero_plugins._files import write_atomic
from hetero_plugins.balancing.planner import BalancePlanner

log = logging.getLogger(__name__)

__all__ = [
    "follow_slots",
    "move_host_slots",
    "predicted_lines",
    "register_state_handler",
    "relocate_by_hosts_file",
    "slot_name",
    "slots_moved",
]


def slot_name() -> str:
    """This worker's slot, ``"host[local rank]"`` (Horovod's names when it set them)."""
    return f"{os.environ.get('HOROVOD_HOSTNAME') or socket.gethostname()}[{os.environ.get('HOROVOD_LOCAL_RANK', '0')}]"


def slots_moved(before: Sequence[str] | None, hosts: Sequence[str], world_size: int) -> bool:
    """Whether the ranks' slots changed since ``before`` at an unchanged world size (the models must follow).

    Example::

        >>> slots_moved(["a[0]", "b[0]"], ["a[0]", "c[0]"], 2), slots_moved(None, ["a[0]"], 1)
        (True, False)
    """
    return not (before is None or list(before) == list(hosts) or len(before) != len(hosts)
                or len(hosts) != world_size)


def predicted_lines(restart_spec: str) -> dict[str, Any]:
    """Each host's entry of the restart spec: ``{"line": [intercept, slope], "batch": the batch size the line stands
    for, or None}`` (empty without a spec).

    Rank 0 reads it inside a collective, so a broken spec must not raise on rank 0 alone: it is reported with a
    warning and the moved ranks start from the fallback line instead.
    """
    from hetero_plugins.scheduler.restart_spec import read_relocation_spec

    try:
        spec = read_relocation_spec(restart_spec) or {}
    except ValueError as err:
        warnings.warn(f"the restart spec is not used: {err}", RuntimeWarning, stacklevel=2)
        spec = {}
    return {r["host"]: {"line": r["line"], "batch": r.get("batch")}
            for r in spec.get("ranks", []) if r.get("host") and r.get("line")}


def follow_slots(planner: BalancePlanner, before: Sequence[str], hosts: Sequence[str],
                 predicted: Mapping[str, Any]) -> None:
    """Give rank i the time model of slot ``hosts[i]`` (from ``before``, rank order of the last boundary); a
    slot without one starts fresh, from its host's ``predicted`` entry (:func:`predicted_lines`) if there is one."""
    rank = {key: r for r, key in enumerate(before)}
    planner.follow_ranks([rank.get(key, -1) for key in hosts])  # model, data wait, cliffs: all follow the slot
    for i, key in enumerate(hosts):
        entry = None if key in rank else predicted.get(key.rsplit("[", 1)[0])
        if entry:
            planner.seed_model(i, entry["line"], batch_size=entry.get("batch"))


def relocate_by_hosts_file(restart_spec: str, hosts_file: str | None, info: dict[str, Any], decision: Any,
                           upcoming: Any) -> None:
    """Rank 0, for a new gaining relocation: write the restart spec and, with a ``hosts_file`` and moves whose
    slots name their hosts, apply it by moving host slots in that file (Horovod then resets onto them).

    Rank 0 runs this inside the collective that hands every rank its decision, so a file it cannot read or write
    (the spec's folder gone, the hosts file replaced, a line it cannot rewrite safely) must not raise on rank 0
    alone: the others would wait for it in that collective. It warns instead, and the relocation is not applied
    (``info["error"]`` says why; the spec is written where it can be).
    """
    from hetero_plugins.scheduler.restart_spec import write_relocation_spec

    places = upcoming.places
    moves = [(places[r].get("host"), upcoming.free_slots[k].get("host")) for r, k in decision.moves]
    apply = hosts_file is not None and all(a and b for a, b in moves)
    try:
        info["spec"] = str(write_relocation_spec(
            restart_spec, decision, places, upcoming.free_slots, epoch=info["epoch"],
            extra={"hosts_file": hosts_file} if apply else None))
        if apply:
            move_host_slots(hosts_file, moves)  # type: ignore[arg-type]
            info["applied"] = "hosts_file"
    except (OSError, ValueError) as err:
        info["error"] = f"{type(err).__name__}: {str(err).rstrip('.')}"
        hint = "" if "HINT" in str(err) else (f" HINT: rank 0 must be able to write the restart spec ({restart_spec}) "
                                              f"and read and replace the hosts file ({hosts_file}).")
        warnings.warn(f"HeteroBatchSampler: relocation {decision.moves} is not applied, training goes on where it is: "
                      f"{info['error']}.{hint}", RuntimeWarning, stacklevel=2)
        return
    log.warning("HeteroBatchSampler: relocation %s predicted %.1f%% faster; spec %s%s", decision.moves,
                100 * decision.predicted_gain, info["spec"],
                f"; {hosts_file} rewritten, Horovod will reset onto the new hosts" if apply else "")


def move_host_slots(path: str, moves: Sequence[tuple[str, str]]) -> None:
    """Rewrite a host-discovery file (``host:slots`` lines): one slot fewer on each ``from`` host, one more on
    each ``to`` host (appended if new); hosts left with no slot are dropped. Replaced atomically.

    A line without a count (``host``) has as many slots as ``horovodrun --slots-per-host`` says, which this
    process cannot know: it is kept as written, and a move from or to such a host raises ``ValueError`` (so does
    a count that is not a whole number) before anything is written.
    """
    order: list[str] = []
    slots: dict[str, int | None] = {}  # None: a line without a count (horovodrun's --slots-per-host)
    with open(path) as f:
        for number, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line:
                continue
            host, colon, n = line.partition(":")
            host = host.strip()
            if colon:
                try:
                    count: int | None = int(n)
                except ValueError:
                    raise ValueError(f"{path}, line {number}: {line!r} is not `host:slots` with a whole number of "
                                     "slots. HINT: write lines like `node1:2`.") from None
            else:
                count = None
            if host not in slots:
                order.append(host)
                slots[host] = count
            elif slots[host] is None or count is None:
                slots[host] = None
            else:
                slots[host] = int(slots[host]) + count  # type: ignore[arg-type]
    for src, dst in moves:
        for host in (src, dst):
            if host in slots and slots[host] is None:
                raise ValueError(f"{path}: host {host!r} is listed without a slot count, so a slot cannot be moved "
                                 f"{'from' if host == src else 'to'} it. HINT: write `{host}:<slots>` in the file "
                                 "your --host-discovery-script prints.")
    for src, dst in moves:
        if (slots.get(src) or 0) > 0:
            slots[src] = int(slots[src]) - 1  # type: ignore[arg-type]
        if dst not in slots:
            order.append(dst)
            slots[dst] = 0
        slots[dst] = int(slots[dst]) + 1  # type: ignore[arg-type]
    write_atomic(path, "".join(h + "\n" if slots[h] is None else f"{h}:{slots[h]}\n"
                               for h in order if slots[h] is None or slots[h] > 0))  # type: ignore[operator]


_ELASTIC_REGISTERED = False


def register_state_handler(sampler_cls: Any) -> None:
    """Let ``hvd.elastic.TorchState`` commit, restore and sync a :class:`sampler_cls` (idempotent)."""
    global _ELASTIC_REGISTERED
    if _ELASTIC_REGISTERED:
        return
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:  # pragma: no cover - Horovod without elastic support
        return
    registry = elastic_state.get_handler_registry()
    if not any(t is sampler_cls for t, _ in registry):
        # Horovod's SamplerStateHandler deep-copies state_dict() on commit, loads it on restore, and
        # broadcasts rank 0's on sync; load_state_dict re-splits the epoch for a new world size.
        elastic_state.set_handler_registry([(sampler_cls, elastic_state.SamplerStateHandler), *registry])
    _ELASTIC_REGISTERED = True
