"""What `--executor ray` checks before it waits on Ray: a cluster that answers, cells that fit a node;
and its settings (`Sweep.ray`, read by `read_settings`).

Ray waits rather than fails in both cases: `ray.init` at an address where nothing listens retries its
connection for minutes (deaf to SIGTERM meanwhile), and a task asking for more CPUs or GPUs than any
node has stays pending for ever. Each is one line here instead, before any cell is submitted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Sequence
from typing import Any

from polgrad.checks import is_int, is_real
from polgrad.errors import PolgradError

# How long the reachability check waits for the address to accept a TCP connection (seconds): a
# cluster's head on a network answers within milliseconds; a firewall that drops packets never does.
CONNECT_TIMEOUT_S = 3.0
# Ray's own words for "this machine": nothing to reach (`auto` reads RAY_ADDRESS, checked as such).
_NO_ADDRESS = ("", "local")


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """`Sweep.ray = {...}`: how the ray executor (polgrad/sweep/ray_cells.py) syncs and restarts cells.

    sync_s    how often a running cell sends what changed in its folder to the driver (seconds): the
              most a lost node can take with it is this much of its cell's files
    retries   how many times a cell whose node (or worker process) died is started again elsewhere
    grace_s   after one rank of a cell spanning nodes failed, how long the other ranks get to report
              and Ray to report a lost node (its health checks take seconds to tens of seconds)
              before the attempt is judged the cell's failure rather than a lost node
    """

    sync_s: float = 1.0
    retries: int = 3
    grace_s: float = 60.0


def read_settings(value: Any) -> RaySettings:
    """`Sweep.ray` as written ({} or a dict of some of RaySettings' fields) -> RaySettings; a ValueError
    whose text names the key, the value and the valid choices (the caller adds the file and line)."""
    fields = [f.name for f in dataclasses.fields(RaySettings)]
    if not isinstance(value, dict):
        raise ValueError(f"must be a dict of some of {', '.join(fields)}, got {value!r}")
    for key, v in value.items():
        if key not in fields:
            raise ValueError(f"unknown key {key!r}; valid: {', '.join(fields)}")
        if key == "retries":
            if not is_int(v) or v < 0:
                raise ValueError(f"'retries' must be an int >= 0 (restarts after a lost node), got {v!r}")
        elif not is_real(v) or not 0 < v < math.inf:
            raise ValueError(f"{key!r} must be a positive number of seconds, got {v!r}")
    return RaySettings(**value)


def check_address(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """One line unless `address` (`--ray-address`; None or 'auto': $RAY_ADDRESS, which ray.init reads
    then) accepts a TCP connection within `timeout_s`: the head's GCS port (host:port) or its Ray
    client port (ray://host:port). No address: ray.init starts a local Ray, nothing to check."""
    flag = "--ray-address"
    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):
        address, flag = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if address in (None, "auto", *_NO_ADDRESS):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")  # an IPv6 host: [::1]:6379
    if not sep or not host or not port.isdigit():
        raise PolgradError(
            f"{flag} {address}: not an address of a Ray cluster; give its head as host:port (the port "
            "`ray start --head` printed, 6379 by default) or ray://host:10001"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        why = (
            f"no answer within {timeout_s:g} s"
            if isinstance(e, TimeoutError)
            else (e.strerror or type(e).__name__).lower()
        )
        raise PolgradError(
            f"{flag} {address}: no Ray cluster answers there ({why}); start it first (`ray start --head` "
            f"on {host}), correct the address, or drop --executor ray to run the cells on this machine"
        ) from None


def _largest(nodes: Sequence[dict[str, Any]], resource: str) -> float:
    return max((float(n.get("Resources", {}).get(resource, 0.0)) for n in nodes), default=0.0)


def _check_gpu_bundles(exp: Any, where: str, world: int, nodes: Sequence[dict[str, Any]]) -> None:
    """One line when the live `nodes` cannot hold the `world` bundles of a GPU cell (1 GPU and
    Sweep.num_cpus / world CPUs each) as Sweep.placement asks: counted per node, a bundle needing
    both on one node (a CPU-rich node without a GPU holds none)."""
    per_cpu = exp.num_cpus / world

    def holds(n: dict[str, Any]) -> int:
        res = n.get("Resources", {})
        gpu = int(float(res.get("GPU", 0.0)))
        return min(gpu, int(float(res.get("CPU", 0.0)) // per_cpu)) if per_cpu > 0 else gpu

    held = [holds(n) for n in nodes]
    total_gpus = sum(float(n.get("Resources", {}).get("GPU", 0.0)) for n in nodes)
    need = f"{world} ranks of 1 GPU and {per_cpu:g} CPUs each (Sweep.num_gpus = {exp.num_gpus:g})"
    if sum(held) < world:
        raise PolgradError(
            f"{where}: {need}, but the Ray cluster's nodes hold {sum(held)} such ranks ({total_gpus:g} "
            "GPUs in all); lower Sweep.num_gpus or Sweep.num_cpus, add GPU nodes, or run CPU cells "
            "(Sweep.num_gpus = 0)"
        )
    if exp.placement == "STRICT_PACK" and max(held) < world:
        raise PolgradError(
            f"{where}: Sweep.placement = 'STRICT_PACK' puts the {need} on one node, but a node holds at most "
            f"{max(held)} of them"
        )
    if exp.placement == "STRICT_SPREAD" and sum(h > 0 for h in held) < world:
        raise PolgradError(
            f"{where}: Sweep.placement = 'STRICT_SPREAD' puts each of the {need} on its own node, but "
            f"{sum(h > 0 for h in held)} nodes hold one: use 'SPREAD' or add GPU nodes"
        )


def check_resources(exp: Any, cell_id: str, world: int, nodes: Sequence[dict[str, Any]]) -> None:
    """One line when the cells (all ask alike: Sweep.num_cpus, num_gpus, processes_per_cell; `cell_id`
    names the first) can never be placed on the live `nodes` (`ray.nodes()`): a task asking for more
    CPUs or GPUs than the largest node has, or a placement group of `world` ranks the cluster cannot
    hold. Ray would keep them pending for ever."""
    nodes = [n for n in nodes if n.get("Alive")]
    cpus, gpus = _largest(nodes, "CPU"), _largest(nodes, "GPU")
    total = sum(float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes)
    where = f"{exp.file}: cell {cell_id}"
    if world == 1 and (exp.num_cpus > cpus or exp.num_gpus > gpus):
        asks = f"{exp.num_cpus:g} CPUs" + (f" and {exp.num_gpus:g} GPUs" if exp.num_gpus else "")
        raise PolgradError(
            f"{where} asks for {asks} (Sweep.num_cpus, Sweep.num_gpus), more than any node of the Ray "
            f"cluster has (at most {cpus:g} CPUs and {gpus:g} GPUs on a node); lower them or add a larger "
            "node"
        )
    if world == 1:
        return
    if exp.num_gpus:  # a GPU cell of `world` ranks: a bundle of 1 GPU and num_cpus / world CPUs each
        _check_gpu_bundles(exp, where, world, nodes)
    if exp.num_cpus / world > cpus:
        raise PolgradError(
            f"{where}: Sweep.num_cpus = {exp.num_cpus:g} gives each of the {world} ranks "
            f"{exp.num_cpus / world:g} CPUs, more than any node of the Ray cluster has ({cpus:g})"
        )
    if exp.placement == "STRICT_PACK" and exp.num_cpus > cpus:
        raise PolgradError(
            f"{where}: Sweep.placement = 'STRICT_PACK' puts the {world} ranks on one node, but no node "
            f"of the Ray cluster has Sweep.num_cpus = {exp.num_cpus:g} CPUs ({cpus:g} at most)"
        )
    if exp.num_cpus > total:
        raise PolgradError(
            f"{where}: Sweep.num_cpus = {exp.num_cpus:g} for a cell of {world} ranks, but the Ray cluster "
            f"has {total:g} CPUs: lower Sweep.num_cpus or add nodes"
        )
    if exp.placement == "STRICT_SPREAD" and world > len(nodes):
        raise PolgradError(
            f"{where}: Sweep.placement = 'STRICT_SPREAD' puts each of the {world} ranks on its own node, "
            f"but the Ray cluster has {len(nodes)}: use 'SPREAD' or add nodes"
        )
