"""What a cluster manager knows about where the ranks run: device types, co-runners, free slots.

A training job cannot see which other jobs share its GPUs or which GPUs sit idle; a cluster manager (Slurm,
Kubernetes, a MIG partitioner...) can. The learned scheduler's stage 2 (:mod:`hetero_plugins.scheduler`) uses
those *identities*, never their slowdowns, which the NCF predicts. The Lightning integration reads them from
a :class:`ClusterView` source given as ``cluster=`` (or the ``HETERO_PLUGINS_CLUSTER`` environment variable):

- a JSON file, re-read at every epoch boundary (the manager rewrites it when it places a job beside a rank);
- or a callable ``cluster(epoch) -> dict``.

Both describe the placement *for* an epoch, in the scenario schema's shape (docs/scheduler.md)::

    {"workload": "training",
     "ranks": [{"device": "v100", "corunner": null}, {"device": "t4", "corunner": "video"}],
     "free_slots": [{"device": "v100", "corunner": null, "host": "node1", "index": 3}]}

Names are free-form here (this layer knows no model); the scheduler checks them against its interference
model's vocabulary where it uses them (:class:`hetero_plugins.scheduler.cluster_advisor.ClusterAdvisor`).
``host`` and ``index`` (the accelerator's index on its node, an int ``>= 0``) are optional; they tell a
relocation restart where a moved rank runs (:mod:`hetero_plugins.scheduler.relocation`). Where ranks are
renumbered behind the manager's back (elastic Horovod), describe slots by host instead and let the job find its
ranks in them::

    {"slots": [{"host": "n1", "device": "v100", "corunner": null}, {"host": "n2", "device": "t4", "corunner": null},
               {"host": "n3", "device": "v100", "corunner": null}]}

Each rank takes the first slot of its host; the slots no rank took are the free ones. The plain-script
Horovod sampler supports this form (it knows each rank's ``HOROVOD_HOSTNAME``).

Example::

    >>> v = parse_cluster({"ranks": [{"device": "v100"}, {"device": "t4", "corunner": "video"}]}, world_size=2)
    >>> v.devices, v.corunners, v.free_slots, v.workload
    (['v100', 't4'], [None, 'video'], [], 'training')
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

__all__ = ["CLUSTER_ENV", "ClusterSource", "ClusterView", "HostsUnknown", "check_host_name", "parse_cluster",
           "read_cluster", "resolve_cluster_source"]

#: Environment variable naming a cluster file when ``cluster=`` is not given.
CLUSTER_ENV = "HETERO_PLUGINS_CLUSTER"

ClusterSource = Union[str, "os.PathLike[str]", Callable[[int], Mapping[str, Any]]]

_HINT = ('use {"workload"?: "training", "ranks": [{"device": "v100", "corunner": null}, ...] (one per rank), '
         '"free_slots"?: [{"device": "v100", "corunner": null}]}')


@dataclass(frozen=True)
class ClusterView:
    """The placement of one epoch.

    Attributes:
        places: each rank's place (``device``, ``corunner``, ``data``, optional ``host``/``index``).
        free_slots: idle places, in the same form.
        workload: this job's workload type (the NCF's user).
    """

    places: list[dict[str, Any]]
    free_slots: list[dict[str, Any]] = field(default_factory=list)
    workload: str = "training"

    @property
    def devices(self) -> list[str]:
        """Each rank's device type (the NCF's item, e.g. ``"v100"``)."""
        return [p["device"] for p in self.places]

    @property
    def corunners(self) -> list[str | None]:
        """The job placed beside each rank (``None``: dedicated)."""
        return [p["corunner"] for p in self.places]


class HostsUnknown(ValueError):
    """A ``slots`` description was read without each rank's host, which it needs to place the ranks."""


#: A host name as Horovod's host-discovery file and DNS take it: dot-separated labels of letters, digits, "-" and
#: "_" (an IPv4 address also matches), at most 253 characters. Anything else, a ":" or a line break above all,
#: could add hosts to the discovery file that the cluster manager never named.
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*$")


def check_host_name(where: str, host: Any) -> str:
    """``host`` if it is a valid host name, else a ``ValueError`` naming ``where``, the value and the fix."""
    if not isinstance(host, str) or not _HOST_NAME.match(host):
        raise _bad(where, host, "use the node's host name (letters, digits, '-', '_' and '.', e.g. \"node-3\"), "
                   "without a port, spaces or line breaks.")
    return host


def _bad(where: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"cluster description field `{where}` is invalid: got {value!r}. HINT: {fix}")


def _place(where: str, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, Mapping) or set(entry) - {"device", "corunner", "data", "host", "index"}:
        raise _bad(where, entry, 'use {"device": name, "corunner": null or a name, "data": seconds, "host": name, '
                   '"index": accelerator index} (all but "device" optional).')
    device, corunner = entry.get("device"), entry.get("corunner")
    if not isinstance(device, str) or not device:
        raise _bad(f"{where}.device", device, 'name the device type, e.g. "v100".')
    if corunner is not None and (not isinstance(corunner, str) or not corunner):
        raise _bad(f"{where}.corunner", corunner, 'use null (dedicated) or the co-located job\'s type, e.g. "video".')
    data = entry.get("data", 0.0)
    if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data) or data < 0:
        raise _bad(f"{where}.data", data, "use a finite number of seconds per step >= 0.")
    out = {"device": device, "corunner": corunner, "data": float(data)}
    host, index = entry.get("host"), entry.get("index")
    if host is not None:
        out["host"] = check_host_name(f"{where}.host", host)
    if index is not None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _bad(f"{where}.index", index, "use the accelerator's index on its node (an int >= 0), e.g. 2 for cuda:2.")
        out["index"] = index
    return out


def parse_cluster(spec: Mapping[str, Any], world_size: int, hosts: Sequence[str] | None = None) -> ClusterView:
    """Validate a cluster description for ``world_size`` ranks; errors name the field, the value and the fix.

    ``hosts`` (each rank's host, in rank order) resolves the ``slots`` form: each rank takes the first slot of
    its host not taken by a lower rank, and the slots left over are the free ones.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"a cluster description must be a JSON object, got {type(spec).__name__}. HINT: {_HINT}")
    unknown = set(spec) - {"workload", "ranks", "free_slots", "slots"}
    if unknown:
        raise _bad(sorted(unknown)[0], spec[sorted(unknown)[0]], f"remove it; {_HINT}")
    if "slots" in spec:
        if "ranks" in spec or "free_slots" in spec:
            raise _bad("slots", spec["slots"], 'give either "slots" (every slot with its "host") or "ranks" and '
                       '"free_slots", not both.')
        spec = _assign_slots(spec, world_size, hosts)
    ranks = spec.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != world_size:
        raise _bad("ranks", ranks, f"give one entry per rank ({world_size}); {_HINT}")
    places = [_place(f"ranks[{i}]", r) for i, r in enumerate(ranks)]
    slots = spec.get("free_slots", [])
    if not isinstance(slots, list):
        raise _bad("free_slots", slots, 'use a list of {"device": name, "corunner": null or a name}.')
    workload = spec.get("workload", "training")
    if not isinstance(workload, str) or not workload:
        raise _bad("workload", workload, 'use the job\'s workload type, e.g. "training".')
    free = [_place(f"free_slots[{k}]", s) for k, s in enumerate(slots)]
    _check_free_slots_distinct(places, free)
    return ClusterView(places, free, workload)


def _check_free_slots_distinct(places: Sequence[Mapping[str, Any]], free: Sequence[Mapping[str, Any]]) -> None:
    """A free slot is an idle accelerator: one that a rank runs on, or that another free slot lists, is not.

    Ranks may share an accelerator (co-located ranks); only places with both ``host`` and ``index`` are compared.
    """
    seen: dict[tuple[str, int], str] = {}
    for r, p in enumerate(places):
        if "host" in p and "index" in p:
            seen.setdefault((p["host"], p["index"]), f"ranks[{r}]")
    for k, s in enumerate(free):
        if "host" not in s or "index" not in s:
            continue
        key = (s["host"], s["index"])
        if key in seen:
            raise _bad(f"free_slots[{k}]", dict(s), f"{seen[key]} already runs on host {key[0]!r} index {key[1]}, so "
                       "that accelerator is not free; remove the slot or give the idle accelerator's index.")
        seen[key] = f"free_slots[{k}]"


def _assign_slots(spec: Mapping[str, Any], world_size: int, hosts: Sequence[str] | None) -> dict[str, Any]:
    """The ``slots`` form as ``ranks`` + ``free_slots``, given each rank's host."""
    slots = spec["slots"]
    if not isinstance(slots, list):
        raise _bad("slots", slots, 'use a list of {"host": name, "device": name, "corunner": null or a name}.')
    places = [_place(f"slots[{k}]", s) for k, s in enumerate(slots)]
    for k, p in enumerate(places):
        if "host" not in p:
            raise _bad(f"slots[{k}].host", None, "name the slot's host: the slots form places ranks by host.")
    if hosts is None or len(hosts) != world_size:
        raise HostsUnknown('the cluster description uses "slots", which needs each rank\'s host, and this integration '
                           'does not know them. HINT: list "ranks" in rank order (and "free_slots") instead.')
    taken: set[int] = set()
    ranks = []
    for r, host in enumerate(hosts):
        k = next((k for k, p in enumerate(places) if p["host"] == host and k not in taken), None)
        if k is None:
            raise _bad("slots", [p["host"] for p in places], f"rank {r} runs on {host!r}, which has no free slot "
                       "left in the description; list one slot per rank on each host.")
        taken.add(k)
        ranks.append(places[k])
    return {"workload": spec.get("workload", "training"), "ranks": ranks,
            "free_slots": [p for k, p in enumerate(places) if k not in taken]}


def resolve_cluster_source(cluster: ClusterSource | None) -> ClusterSource | None:
    """``cluster`` as given, else the file named by ``HETERO_PLUGINS_CLUSTER``, else ``None``."""
    if cluster is not None:
        if not (callable(cluster) or isinstance(cluster, (str, os.PathLike))) or (isinstance(cluster, str)
                                                                                  and not cluster.strip()):
            raise ValueError(f"`cluster`={cluster!r} is not usable. HINT: pass the path of a cluster JSON file or a "
                             "callable epoch -> dict (see hetero_plugins.cluster).")
        if not callable(cluster) and os.path.isdir(cluster):
            raise ValueError(f"`cluster`={str(cluster)!r} is a directory. HINT: pass the cluster JSON file in it.")
        return cluster
    env = os.environ.get(CLUSTER_ENV)
    return env or None


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a number JSON allows", name, 0)


def read_cluster(source: ClusterSource, epoch: int, world_size: int, hosts: Sequence[str] | None = None) -> ClusterView:
    """The placement for ``epoch`` from a file (read now) or a callable (called with ``epoch``); ``hosts``: each
    rank's host, for the ``slots`` form.

    Raises:
        ValueError: the file is missing (also when it vanishes while being read), unreadable, not UTF-8, not
            JSON, or not a valid description; the message names the file and the fix. At an epoch boundary the
            integrations catch it, warn once per message and decide without the new description, keeping the
            placement in force (:class:`~hetero_plugins.scheduler.cluster_advisor.ClusterAdvisor`).
    """
    if callable(source):
        spec = source(epoch)
        origin = f"cluster({epoch})"
    else:
        path = Path(source)
        missing = (f"cluster file {str(path)!r} does not exist. HINT: write it before training (see "
                   f"hetero_plugins.cluster), or unset `cluster` / {CLUSTER_ENV}; a manager should replace it "
                   "atomically (write a temporary file, then rename), never delete it first.")
        if not path.is_file():
            if path.exists():
                raise ValueError(f"cluster file {str(path)!r} is not a file. HINT: write it before training (see "
                                 f"hetero_plugins.cluster), or unset `cluster` / {CLUSTER_ENV}.")
            raise ValueError(missing)
        try:  # the file can vanish or change between the check and the read (a manager rewriting it)
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(missing) from None
        except UnicodeDecodeError as err:
            raise ValueError(f"cluster file {str(path)!r} is not UTF-8 text ({err}). HINT: write the description "
                             "as UTF-8 JSON (see hetero_plugins.cluster).") from None
        except OSError as err:
            raise ValueError(f"cluster file {str(path)!r} cannot be read ({type(err).__name__}: {err}). HINT: make "
                             "it readable by the training job, or unset `cluster` / "
                             f"{CLUSTER_ENV}.") from None
        try:
            spec = json.loads(text, parse_constant=_no_constant)
        except RecursionError:
            raise ValueError(f"cluster file {str(path)!r} is nested too deeply to be a cluster description. HINT: "
                             "write the flat form of hetero_plugins.cluster (ranks, free_slots or slots).") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"cluster file {str(path)!r} is not valid JSON: {err}. HINT: fix the JSON syntax; "
                             "a manager should write the file atomically (write a temporary file, then rename).") from err
        origin = str(path)
    try:
        return parse_cluster(spec, world_size, hosts)
    except ValueError as err:
        raise type(err)(f"{origin}: {err}") from None
